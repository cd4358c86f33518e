"""Draw the physical KV block pool at a few moments of a small workload, paged (block_size 4) beside
contiguous reservation (block_size = max_model_len = 32) in the same memory, as the PagedAttention
paper's figures do. One cell per block, coloured by the sequence that owns it: solid slots hold a
token, pale ones are allocated but unused; a block shared by several sequences (prefix cache, forked
parallel samples) is outlined in black with its ref count.

    python scripts/plot_block_pool.py [--out docs/block_pool.png --moments 1,3,5,7]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.patches import Patch, Rectangle  # noqa: E402

from models.llama import preset  # noqa: E402
from paged_jax import LLM, SamplingParams  # noqa: E402
from scripts.benchlib import block_fill, random_weights  # noqa: E402

MAX_MODEL_LEN = 32  # tokens per contiguous reservation: one row of the picture
KV_TOKENS = 4 * MAX_MODEL_LEN  # the memory both pools get
SHARED = list(range(10, 18))  # C and D's common prefix: two full blocks of 4
# (name, arrival step, prompt, sampling params); D arrives once C's prefix blocks are cached.
WORKLOAD = [("A", 0, list(range(30, 39)), SamplingParams(temperature=0.0, max_tokens=11, ignore_eos=True)),
            ("B", 0, list(range(40, 46)), SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)),
            ("C", 0, SHARED + [50, 51, 52], SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True)),
            ("D", 2, SHARED + [60, 61, 62, 63, 64], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)),
            ("E", 0, list(range(70, 76)), SamplingParams(n=2, temperature=1.0, seed=0, max_tokens=7, ignore_eos=True))]
COLOURS = dict(zip(["A", "B", "C", "D", "E1", "E2"], plt.get_cmap("tab10").colors))


def simulate(model, block_size: int, moments: list[int]) -> list[dict]:
    """Run the workload, one `engine.step()` at a time, and read the pool after each step in `moments`."""
    llm = LLM(model, block_size=block_size, num_blocks=KV_TOKENS // block_size + 1, max_num_seqs=8,
              max_num_batched_tokens=32, max_model_len=MAX_MODEL_LEN, num_decode_steps=2, log_stats=False,
              async_scheduling=False)  # one device call a step, its outputs processed in it
    engine, owners, shots, running = llm.engine, {}, [], []  # owners: slot -> the last sequence seen in it
    for step in range(1, max(moments) + 1):
        for name, arrival, prompt, params in WORKLOAD:
            if arrival == step - 1:
                engine.add_request(name, prompt, params)
        finished = {out.request_id for out in engine.step() if out.finished}
        done = sorted(label for label in running if label[0] in finished)  # their blocks are free already
        running = [seq.request.request_id + (str(seq.index + 1) if seq.request.params.n > 1 else "")
                   for seq in engine.scheduler.running]
        owners.update((seq.slot, label) for seq, label in zip(engine.scheduler.running, running))
        if step in moments:
            pool = engine.block_pool
            held, ref = block_fill(pool)
            tables, lens = np.array(pool.block_tables), np.array(pool.seq_lens)
            owner_blocks = {owners[slot]: tables[slot, : -(-int(lens[slot]) // block_size)].tolist()
                            for slot in sorted(owners) if lens[slot] > 0}
            block_owner = {}
            for label, blocks in owner_blocks.items():  # the first sequence that maps a block colours it
                for b in blocks:
                    block_owner.setdefault(b, label)
            shots.append(dict(step=step, held=held, ref=ref, cached=np.array(pool.cached), owner=block_owner,
                              owner_blocks=owner_blocks,
                              running=sorted(running), waiting=[s.request.request_id for s in engine.scheduler.waiting],
                              # finished in this step: the engine frees their blocks with its next device call
                              done=done))
    return shots


def draw(ax, shot, block_size: int, title: str) -> None:
    per_row = MAX_MODEL_LEN // block_size
    for b in range(1, len(shot["ref"])):  # block 0 is the null block: never handed out
        x, y = ((b - 1) % per_row) * block_size, (b - 1) // per_row
        owner = shot["owner"].get(b) if shot["ref"][b] > 0 else None
        if owner is None:
            face = "0.75" if shot["cached"][b] else "white"
            ax.add_patch(Rectangle((x, -y), block_size, -0.8, facecolor=face, edgecolor="0.4",
                                   hatch="//" if shot["cached"][b] else None, lw=0.8))
            continue
        colour = COLOURS[owner]
        ax.add_patch(Rectangle((x, -y), block_size, -0.8, facecolor=colour, alpha=0.25, lw=0))
        ax.add_patch(Rectangle((x, -y), int(shot["held"][b]), -0.8, facecolor=colour, lw=0))
        shared = shot["ref"][b] > 1
        ax.add_patch(Rectangle((x, -y), block_size, -0.8, fill=False, edgecolor="black" if shared else "0.4",
                               lw=2.2 if shared else 0.8))
        ax.text(x + 0.5, -y - 0.4, owner + (f" ×{shot['ref'][b]}" if shared else ""), va="center", fontsize=7,
                fontweight="bold" if shared else "normal")
    ax.set_xlim(-0.5, MAX_MODEL_LEN + 0.5)
    ax.set_ylim(-(KV_TOKENS // MAX_MODEL_LEN) - 0.1, 0.3)
    ax.set_xticks(range(0, MAX_MODEL_LEN + 1, block_size if block_size < MAX_MODEL_LEN else 8))
    ax.set_yticks([])
    ax.tick_params(labelsize=7)
    held = int(shot["held"].sum())
    slots = int((shot["ref"][1:] > 0).sum()) * block_size
    names = {k: " ".join(shot[k]) or "-" for k in ("running", "done", "waiting")}
    ax.set_title(f"{title}, after step {shot['step']}: {held}/{slots} allocated slots hold a token\nrunning "
                 f"{names['running']}; finished (blocks freed) {names['done']}; waiting {names['waiting']}",
                 fontsize=8)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent.parent / "docs" / "block_pool.png"))
    ap.add_argument("--moments", default="1,3,5,7", help="engine steps after which to draw the pool")
    ap.add_argument("--dpi", type=int, default=110)
    args = ap.parse_args(argv)
    moments = sorted({int(m) for m in args.moments.split(",")})
    model = random_weights(preset("tiny"))
    paged, contiguous = simulate(model, 4, moments), simulate(model, MAX_MODEL_LEN, moments)
    fig, axes = plt.subplots(len(moments), 2, figsize=(10, 2.0 * len(moments) + 0.8), squeeze=False)
    for row, (p, c) in enumerate(zip(paged, contiguous)):
        draw(axes[row, 0], p, 4, "paged, block_size 4")
        draw(axes[row, 1], c, MAX_MODEL_LEN, f"contiguous reservation, block_size {MAX_MODEL_LEN}")
    legend = [Patch(facecolor=c, label=n) for n, c in COLOURS.items()] + [
        Patch(facecolor="0.6", alpha=0.3, label="allocated, holds no token (yet)"),
        Patch(facecolor="0.75", hatch="//", edgecolor="0.4", label="free, holds a cached prefix"),
        Patch(facecolor="white", edgecolor="0.4", label="free"),
        Patch(facecolor="white", edgecolor="black", lw=2.2, label="shared (×ref count)")]
    fig.legend(handles=legend, loc="lower center", ncol=5, fontsize=7, frameon=False)
    fig.suptitle(f"The same {KV_TOKENS} KV token slots: blocks allocated on demand vs a "
                 f"{MAX_MODEL_LEN}-token reservation per sequence (x: token offset in a row of the pool)", fontsize=9)
    fig.tight_layout(rect=(0, 0.07, 1, 0.97))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=args.dpi)
    print(f"wrote {args.out} ({Path(args.out).stat().st_size // 1024} KiB)")


if __name__ == "__main__":
    main()
