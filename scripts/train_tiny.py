"""Train the embedded default model: a small Llama on the Python standard library's own source.

    python scripts/train_tiny.py [--out models/embedded] [--steps 600]

Corpus: the running interpreter's `Lib/**/*.py` (sorted; PSF licence, ships with every Python) less
test suites, generated tables (SKIP_DIRS) and the HELD_OUT files, which give the held-out loss. A
byte-level BPE tokenizer is trained on the training files; every file is encoded as
`<|endoftext|> text` (the tokenizer prepends the token, so a prompt reads as the start of a file) and
the model learns to end a file with the next one's token, its EOS. Writes
OUT/{config.json, tokenizer.json, state/, loss_curve.csv}.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import sysconfig
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import tokenizers  # noqa: E402
from flax import nnx  # noqa: E402
from tokenizers import Regex, decoders, pre_tokenizers, processors, trainers  # noqa: E402

from models import Llama, LlamaConfig, save_orbax  # noqa: E402

EOT = "<|endoftext|>"
# Held out for evaluation: self-contained modules present in every Python 3 release.
HELD_OUT = ("calendar.py", "fractions.py", "heapq.py", "shlex.py", "textwrap.py")
# Test suites (a third of Lib, mostly repetitive asserts), installed packages, and generated data:
# codec tables (encodings/) and the pydoc topics dump are not code anyone writes.
SKIP_DIRS = {"site-packages", "test", "tests", "idle_test", "encodings", "pydoc_data"}
# 4.2M parameters (1M of them the tied embedding), GQA, EOT (id 0) as BOS and EOS.
MODEL = dict(hidden_size=256, intermediate_size=768, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=64,
             rope_theta=10000.0, tie_word_embeddings=True, bos_token_id=0, eos_token_id=0, dtype="float32")
EVAL_EVERY = 100  # steps


def corpus_files(stdlib=None) -> tuple[list[Path], list[Path]]:
    """(training files, held-out files) of `stdlib` (default: the running interpreter's)."""
    root = Path(stdlib or sysconfig.get_paths()["stdlib"])
    files = [f for f in sorted(root.rglob("*.py")) if not SKIP_DIRS & set(f.relative_to(root).parts[:-1])]
    held = {root / name for name in HELD_OUT}
    return [f for f in files if f not in held], [f for f in files if f in held]


def read(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def train_tokenizer(files, vocab_size) -> tokenizers.Tokenizer:
    """GPT-2-style byte-level BPE (no unknown bytes), EOT id 0 prepended to every encoded text."""
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    # Newlines are split from the indentation after them: merged, a prompt ending in "\n" would end
    # on a token that in training only ever precedes column 0, and the model would never indent.
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(r"\n+"), behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([read(f) for f in files], trainer)
    tok.post_processor = processors.TemplateProcessing(single=f"{EOT} $A", special_tokens=[(EOT, 0)])
    return tok


def encode_files(tok, files) -> np.ndarray:  # i32[num_tokens]: the files one after another
    return np.concatenate([np.asarray(e.ids, np.int32) for e in tok.encode_batch([read(f) for f in files])])


def make_train_step(graphdef, tx):
    def loss_fn(params, batch):  # batch i32[batch, seq_len + 1]
        logits = nnx.merge(graphdef, params).dense_logits(batch[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()

    @jax.jit
    def train_step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return train_step, jax.jit(loss_fn)  # the second: (params, windows) -> mean loss per token


def save_bf16(params, config: LlamaConfig, out: Path):
    """Trained in float32, shipped in bfloat16: half the bytes in the repository, and the held-out
    loss moves in the fourth digit."""
    config = dataclasses.replace(config, dtype="bfloat16")
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0))))
    nnx.replace_by_pure_dict(state, jax.tree.map(lambda x: x.astype(jnp.bfloat16), nnx.to_pure_dict(params)))
    save_orbax(nnx.merge(graphdef, state), out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent.parent / "models" / "embedded"))
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=256, help="training window, also max_position_embeddings")
    ap.add_argument("--lr", type=float, default=3e-3, help="peak; warm-up over a sixth of the steps, cosine to a tenth")
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    start, out, t = time.perf_counter(), Path(args.out), args.seq_len
    out.mkdir(parents=True, exist_ok=True)

    train_files, held_files = corpus_files()
    tok = train_tokenizer(train_files, args.vocab_size)
    tok.save(str(out / "tokenizer.json"))
    train_ids, held_ids = encode_files(tok, train_files), encode_files(tok, held_files)
    print(f"corpus: {len(train_files)} training files, {train_ids.size} tokens; held out {len(held_files)} files, "
          f"{held_ids.size} tokens; tokenizer {time.perf_counter() - start:.0f} s")

    config = LlamaConfig(vocab_size=tok.get_vocab_size(), **MODEL, max_position_embeddings=t)
    graphdef, params = nnx.split(Llama(config, rngs=nnx.Rngs(args.seed)))
    num_params = sum(x.size for x in jax.tree.leaves(params))
    schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, args.steps // 6, args.steps, args.lr / 10)
    # Decay the layers' matrices only ([num_layers, ...] with ndim >= 3): norm gains ([num_layers,
    # hidden], [hidden]) and the tied embedding ([vocab, hidden]) are not pulled towards zero.
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(
        schedule, b1=0.9, b2=0.95, weight_decay=0.1, mask=lambda p: jax.tree.map(lambda x: x.ndim >= 3, p)))
    opt_state = tx.init(params)
    train_step, eval_loss = make_train_step(graphdef, tx)
    # Held-out text in consecutive windows, each token predicted once; evaluated a batch at a time.
    held_windows = np.stack([held_ids[i * t: i * t + t + 1] for i in range((held_ids.size - 1) // t)])
    held_batches = np.array_split(held_windows, -(-len(held_windows) // args.batch_size))
    rng = np.random.default_rng(args.seed)
    print(f"model: {num_params / 1e6:.2f}M parameters, {args.steps} steps of {args.batch_size}x{t} tokens "
          f"({args.steps * args.batch_size * t / train_ids.size:.2f} epochs)")

    rows, recent, train_start = [], [], time.perf_counter()
    for step in range(1, args.steps + 1):
        starts = rng.integers(0, train_ids.size - t - 1, args.batch_size)
        params, opt_state, loss = train_step(params, opt_state, np.stack([train_ids[s: s + t + 1] for s in starts]))
        recent.append(loss)
        if step % EVAL_EVERY == 0 or step == args.steps:
            train_loss = float(np.mean(jax.device_get(recent)))
            held_loss = float(np.average([eval_loss(params, b) for b in held_batches],
                                         weights=[len(b) for b in held_batches]))
            elapsed = time.perf_counter() - train_start
            rows.append(dict(step=step, train_loss=round(train_loss, 4), heldout_loss=round(held_loss, 4),
                             lr=float(schedule(step)), elapsed_s=round(elapsed, 1)))
            print(f"step {step:5d}  train {train_loss:.3f}  held-out {held_loss:.3f} "
                  f"(ppl {np.exp(held_loss):.1f})  {elapsed:.0f} s", flush=True)
            recent = []

    (out / "loss_curve.csv").write_text(
        ",".join(rows[0]) + "\n" + "".join(",".join(str(v) for v in row.values()) + "\n" for row in rows))
    save_bf16(params, config, out)
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    print(f"saved {out}: {num_params / 1e6:.2f}M params, {size / 2**20:.2f} MiB; final train loss {train_loss:.3f}, "
          f"held-out {held_loss:.3f} (perplexity {np.exp(held_loss):.1f}, uniform {config.vocab_size}); "
          f"total {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
