"""Train a small character-level GPT on device "tpu" (the `make demo` example).

Plain PyTorch training code: the only tpu-specific line is the device string.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from examples.gpt import GPT, GPTConfig  # noqa: E402

import torch_tpu  # noqa: E402  (optional: `import torch` alone autoloads it; imported here for metrics)


def load_corpus(path: str):
    text = open(path, encoding="utf-8").read()
    chars = sorted(set(text))
    stoi = {c: i for i, c in enumerate(chars)}
    data = torch.tensor([stoi[c] for c in text], dtype=torch.long)
    return data, chars


def precision_text(device: torch.device) -> str:
    """The float32 matmul precision this run's products use, and where it comes from."""
    if device.type != "tpu":
        return f"float32 matmul precision '{torch.get_float32_matmul_precision()}' (PyTorch's setting)"
    level, source = torch_tpu.precision.matmul_precision(), torch_tpu.precision.source()
    why = {"default": "the tpu default: bfloat16 operands, float32 accumulation" if level == "medium" else "default",
           "torch": "set with torch.set_float32_matmul_precision",
           "torch_tpu.precision.use": "set with torch_tpu.precision.use"}.get(source, source)
    return f"float32 matmul precision '{level}' ({why})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="tpu")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--data", default=os.path.join(os.path.dirname(__file__), "data", "corpus.txt"))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    data, chars = load_corpus(args.data)
    split = int(0.9 * len(data))
    train, val = data[:split], data[split:]
    config = GPTConfig(vocab_size=len(chars), block_size=args.block_size, n_layer=args.layers,
                       n_head=max(1, args.d_model // 64), n_embd=args.d_model)
    model = GPT(config).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"device {device} ({torch.tpu.get_device_name() if device.type == 'tpu' else device.type}), "
          f"{n_params / 1e6:.2f}M parameters, {len(chars)} characters, {precision_text(device)}")

    def batch(source):
        ix = torch.randint(len(source) - args.block_size - 1, (args.batch_size,))
        x = torch.stack([source[i:i + args.block_size] for i in ix])
        y = torch.stack([source[i + 1:i + 1 + args.block_size] for i in ix])
        return x.to(device), y.to(device)

    tokens_per_step = args.batch_size * args.block_size
    # A bar in a terminal; in a log (not a terminal) no bar lines at all, one summary line at the end.
    interactive = sys.stderr.isatty()
    progress = tqdm(range(args.steps), desc="training", unit="step", disable=not interactive)
    start = last = time.perf_counter()
    value = float("nan")
    for step in progress:
        x, y = batch(train)
        _, loss = model(x, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if step % 10 == 0 or step == args.steps - 1:
            value = loss.item()  # a materialization point: waits for the device
            now = time.perf_counter()
            steps_done = 10 if step else 1
            progress.set_postfix(loss=f"{value:.3f}", tok_s=f"{tokens_per_step * steps_done / (now - last):,.0f}")
            last = now
    if not interactive:
        seconds = time.perf_counter() - start
        print(f"training: {args.steps} steps in {seconds:.1f} s, loss {value:.3f}, "
              f"{tokens_per_step * args.steps / seconds:,.0f} tokens/s (first steps include compiling)")

    model.eval()
    with torch.no_grad():
        x, y = batch(val)
        _, val_loss = model(x, y)
    print(f"validation loss {val_loss.item():.3f}")
    prompt = torch.tensor([[chars.index(c) for c in "The "]], device=device)
    sample = model.generate(prompt, max_new_tokens=80, pad=chars.index("\n"))[0].tolist()
    print("sample:", repr("".join(chars[i] for i in sample)))
    if device.type == "tpu":
        print(torch_tpu.metrics.report())


if __name__ == "__main__":
    main()
