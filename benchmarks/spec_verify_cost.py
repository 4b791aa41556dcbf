"""What verifying k proposed tokens costs the target's projections: every packed linear of the default model
(float32) on 1, 2, 3, 5 and 9 rows (a plain decode step and verification of k = 1, 2, 4, 8), best of
``--passes`` interleaved passes. The shape of this curve is why adaptive speculation measures a step's
extra cost per proposal length and not per token (pdserve/engine/spec_decode/adaptive.py).

    python -m benchmarks.spec_verify_cost [--threads 1] [--passes 8]
"""

from __future__ import annotations

import argparse
import time


def main(argv: list[str] | None = None) -> dict[int, float]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--passes", type=int, default=8)
    args = parser.parse_args(argv)
    import torch

    from pdserve.engine import LLM
    from pdserve.engine.layers.linear import PackedLinear

    torch.set_num_threads(args.threads)
    model = LLM(dtype="float32", num_kv_blocks=64).engine.runner.model
    layers = [module for module in model.modules() if isinstance(module, PackedLinear)]
    rows = (1, 2, 3, 5, 9)
    inputs = {n: [torch.randn(n, layer.weight.shape[1]) for layer in layers] for n in rows}
    best = {n: float("inf") for n in rows}
    with torch.inference_mode():
        for _ in range(args.passes):
            for n in rows:
                start = time.perf_counter()
                for layer, x in zip(layers, inputs[n]):
                    layer(x)
                best[n] = min(best[n], time.perf_counter() - start)
    print(f"{len(layers)} projections, {args.threads} thread(s), best of {args.passes}")
    for n in rows:
        print(f"  {n} rows: {best[n] * 1000:7.1f} ms  {best[n] / best[1]:.2f}x one row")
    return best


if __name__ == "__main__":
    main()
