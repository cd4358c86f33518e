"""scripts/profile_decode.py on the embedded model: the weight bytes it reports are the runner's,
every part of the decode step gets a share and the shares add up; its classifier on the lines XLA
writes. Timings are printed, never checked."""
import re

import jax

from paged_jax import LLM
from scripts import profile_decode

VOCAB = 49152


def test_the_classifier_reads_what_xla_writes():
    lm_head = "%dot.87 = f32[1,49152]{1,0} dot(%a, %b), lhs_contracting_dims={0}, rhs_contracting_dims={1}"
    matmul = "%dot.84 = f32[1,1536]{1,0} dot(%a, %b), metadata={op_name=\"jit(decode_steps)/while/body/layers/mlp/dot_general\"}"
    sliced = ("%dynamic-slice_bitcast_fusion.2 = f32[576,1536]{1,0} fusion(%w, %i), kind=kLoop, "
              "metadata={op_name=\"jit(decode_steps)/while/body/layers/while/body/dynamic_slice\"}")
    attention = "%gather.3 = f32[8,3,16,64]{3,2,1,0} gather(%p, %i), metadata={op_name=\"x/layers/attention/gather\"}"
    sampler = "%reduce.1 = f32[1,49152]{1,0} reduce(%l, %c), metadata={op_name=\"jit(decode_steps)/while/body/argmax\"}"
    norm = "%rsqrt.2 = f32[1]{0} rsqrt(%x), metadata={op_name=\"jit(decode_steps)/while/body/layers/rsqrt\"}"
    assert [profile_decode.part(line, VOCAB) for line in (lm_head, matmul, sliced, attention, sampler, norm)] == [
        "LM head", "layer matmuls", "weight slices", "attention", "sampler", "other"]


def test_only_this_programs_executions_count():
    """Another engine's decode_steps, running meanwhile in the process, has the same module name and
    some op names alike (CI once saw 68% "other", 0% LM head): its execution is left out."""
    hlo = ("%dot.87 = f32[1,49152]{1,0} dot(%a, %b)\n"
           "%rsqrt.2 = f32[1]{0} rsqrt(%x), metadata={op_name=\"jit(decode_steps)/while/body/layers/rsqrt\"}")

    def op(name, run, dur):
        return dict(ph="X", name=name, dur=dur, args=dict(hlo_module="jit_decode_steps", run_id=run))

    events = [op("dot.87", "1", 30.0), op("rsqrt.2", "1", 10.0), op("dot.87", "2", 50.0),
              op("dot.87", "3", 999.0), op("fusion.9", "3", 1.0),  # a foreign execution
              dict(ph="X", name="dot.87", dur=999.0, args=dict(hlo_module="jit_other", run_id="4"))]
    seconds = profile_decode.op_seconds(events, hlo, VOCAB, calls=2)
    assert seconds.keys() == {"LM head", "other"}
    assert abs(seconds["LM head"] - 40e-6) < 1e-12 and abs(seconds["other"] - 5e-6) < 1e-12  # (30 + 50) / 2, 10 / 2


def test_it_reports_the_runners_weights_and_every_part(capsys, optimized_compiles):
    profile_decode.main(["--model", "models/embedded", "--batch-sizes", "1", "2"])
    out = capsys.readouterr().out
    weights = sum(x.nbytes for x in jax.tree.leaves(LLM("models/embedded", log_stats=False).engine.model_runner.params))
    assert f"weights {weights / 1e6:.0f} MB" in out
    lines = [line for line in out.splitlines() if line.startswith("batch ")]
    assert [line.split(":")[0] for line in lines] == ["batch 1", "batch 2"]
    for line in lines:
        shares = {name.strip(): int(pct) for name, pct in re.findall(r"([a-zA-Z ]+?) (\d+)%", line.split("XLA op time: ")[1])}
        assert list(shares) == list(profile_decode.PARTS)
        assert 97 <= sum(shares.values()) <= 103 and shares["layer matmuls"] > 0 and shares["LM head"] > 0, line
