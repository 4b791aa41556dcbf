"""A mixture-of-experts decode step against its dense twin and against its own memory bound.

    python -m benchmarks.moe_step [--dtype float32] [--quantization int8] [--repeats 3]

Two random checkpoints of the same width, depth and attention (SmolLM2-135M's: hidden 576, 9 heads, 3 KV
heads; ``--num-layers`` layers): a Qwen3-MoE with ``--experts`` experts of ``--expert-width`` columns,
``--top-k`` per token, in every layer; and a dense Qwen3 whose MLP is ``top_k * expert_width`` wide, the same
active parameters per token. For each, one process, settings alternating within every repeat, best of
``--repeats``:

- the decode step at batch 1 and at batch 32 (32 prompts of 64 random tokens; ``(time of 1 + 24 new tokens)
  - (time of 1 new token)`` over 24 steps);
- the MoE step again with each expert in a call of its own (``grouped`` unset: what the grouped kernels save);
- at batch 32, the step's memory bound: the bytes a step must read (every weight but the unused experts'
  and the embedding rows, plus the batch's KV), over the machine's read rate (``Tensor.sum`` over 512 MB,
  measured before and after the steps, the better kept: a shared machine's neighbours lower either). The
  experts a step touches are counted from the routing of the run itself;
- at batch 32, the step's compute bound: the multiply-adds of its projections (attention, router, every
  token's ``top_k`` experts, LM head) at the instruction peak of the kernel that runs each of them
  (``benchmarks.instruction_peaks``, measured in the same run, one core's rate times the threads). Work
  whose peak is not measured (bf16 products, attention's scores) is left out, so both bounds are lower
  bounds of the step; the step's bound is the larger;
- at batch 32, the step's phase roofline: attention's projections, its KV, the router, the experts and the
  LM head one after another, each at the larger of its bytes at the read rate and its multiply-adds at its
  peak (phases wait on each other, so one's spare bandwidth cannot serve another's arithmetic); and the read
  rate above which 1.5x the memory bound is below that roofline (the "crossover").

Targets (the issue of MoE serving): batch-1 step within 1.5x of the dense twin's; batch-32 step within
1.5x of its memory bound. Out of reach where the phase roofline alone is above 1.5x the memory bound,
which happens on any run whose read rate is above the crossover: a batch of 32 rows makes 16 multiply-adds
of every float32 weight byte read, 64 of every int8 one, and the LM head's and attention's arithmetic does
not shrink when the memory gets faster.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks import instruction_peaks
from benchmarks.machine_limits import BANDWIDTH_BUFFER_BYTES, measure_bandwidth_gbps
from benchmarks.random_checkpoint import SMOLLM2_135M, write_config_checkpoint

PROMPT_LEN = 64
NEW_TOKENS = 24
BATCH = 32


def _config(moe: bool, args: argparse.Namespace) -> Any:
    from transformers import Qwen3Config, Qwen3MoeConfig

    fields = {k: v for k, v in SMOLLM2_135M.items() if k not in ("intermediate_size",)}
    fields["num_hidden_layers"] = args.num_layers
    fields["max_position_embeddings"] = 1024
    if moe:
        return Qwen3MoeConfig(
            **fields, intermediate_size=args.top_k * args.expert_width, moe_intermediate_size=args.expert_width,
            num_experts=args.experts, num_experts_per_tok=args.top_k, norm_topk_prob=True, decoder_sparse_step=1,
            mlp_only_layers=[],
        )
    return Qwen3Config(**fields, intermediate_size=args.top_k * args.expert_width)


def _write(folder: Path, config: Any) -> Path:
    return write_config_checkpoint(folder, config)


def _decode_step_s(llm: Any, batch: int) -> float:
    from pdserve.engine import SamplingParams

    generator = torch.Generator().manual_seed(batch)
    prompts = [torch.randint(10, 49000, (PROMPT_LEN,), generator=generator).tolist() for _ in range(batch)]
    first = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    more = SamplingParams(max_tokens=1 + NEW_TOKENS, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    llm.generate(prompts, first)
    prefill = time.perf_counter() - start
    start = time.perf_counter()
    llm.generate(prompts, more)
    return (time.perf_counter() - start - prefill) / NEW_TOKENS


class _ExpertCounter:
    """Distinct experts each MoE layer ran in its steps (wraps the layers' forward)."""

    def __init__(self, model: Any) -> None:
        from pdserve.engine.models.llama import MoE

        self.per_step: list[int] = []
        for layer in model.model.layers:
            if isinstance(layer.mlp, MoE):
                self._wrap(layer.mlp)

    def _wrap(self, moe: Any) -> None:
        forward = moe.forward
        counter = self

        def counting(x: torch.Tensor) -> torch.Tensor:
            logits = torch.nn.functional.linear(x, moe.gate.weight)
            chosen = torch.topk(logits, moe.options.top_k, dim=-1).indices
            counter.per_step.append(len(torch.unique(chosen)))
            return forward(x)

        moe.forward = counting


def _kv_element_size(model: Any) -> int:
    """Bytes of one cached key or value element: the KV cache holds the model's activation dtype."""
    return model.model.norm.weight.element_size()


def _bytes_per_step(model: Any, experts_touched: float, context: int) -> float:
    """Weights a batch-32 decode step reads (the unused experts' and the embedding's excluded) plus its KV."""
    from pdserve.engine.models.llama import MoE

    total = 0.0
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        if "embed_tokens" in name or "rotary" in name:
            continue
        total += tensor.numel() * tensor.element_size()
    for layer in model.model.layers:
        if isinstance(layer.mlp, MoE):
            per_expert = sum(p.numel() * p.element_size() for p in layer.mlp.experts[0].parameters())
            per_expert += sum(b.numel() * b.element_size() for b in layer.mlp.experts[0].buffers())
            total -= per_expert * (len(layer.mlp.experts) - experts_touched)
    attn = model.model.layers[0].self_attn
    kv = 2 * len(model.model.layers) * attn.num_kv_heads * attn.head_dim * _kv_element_size(model) * context * BATCH
    return total + kv


def _macs_per_step(config: Any, batch: int) -> dict[str, int]:
    """Multiply-adds of a decode step's projections, by what multiplies them: ``decoder`` (attention, experts,
    dense MLPs: the model's linear method), ``router`` (a float ``nn.Linear``) and ``head`` (the LM head)."""
    hidden, head_dim = config.hidden_size, config.head_dim
    attention = hidden * head_dim * (2 * config.num_attention_heads + 2 * config.num_key_value_heads)
    experts = getattr(config, "num_experts", 0)
    per_layer = attention + (
        config.num_experts_per_tok * 3 * hidden * config.moe_intermediate_size if experts
        else 3 * hidden * config.intermediate_size
    )
    return {
        "decoder": batch * config.num_hidden_layers * per_layer,
        "router": batch * config.num_hidden_layers * hidden * experts,
        "head": batch * hidden * config.vocab_size,
    }


def _phase_bytes(model: Any, experts_touched: float, context: int) -> dict[str, float]:
    """``_bytes_per_step``'s bytes by the phase of the step that reads them: ``attention`` (its projections and
    norms), ``kv`` (the batch's keys and values), ``router``, ``experts`` (the touched ones'), ``head`` (the LM head)
    and ``other`` (the decoder's norms)."""
    import re

    from pdserve.engine.models.llama import MoE

    phases = dict.fromkeys(("attention", "kv", "router", "experts", "head", "other"), 0.0)
    expert_name = re.compile(r"\.mlp\.(experts\.\d+|gate_up_proj|down_proj|gate_proj|up_proj)\.")
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        if "embed_tokens" in name or "rotary" in name:
            continue
        size = tensor.numel() * tensor.element_size()
        if name.startswith("lm_head"):
            phases["head"] += size
        elif ".self_attn." in name:
            phases["attention"] += size
        elif ".mlp.gate." in name:
            phases["router"] += size
        elif expert_name.search(name):
            phases["experts"] += size
        else:
            phases["other"] += size
    for layer in model.model.layers:
        if isinstance(layer.mlp, MoE):
            per_expert = sum(p.numel() * p.element_size() for p in layer.mlp.experts[0].parameters())
            per_expert += sum(b.numel() * b.element_size() for b in layer.mlp.experts[0].buffers())
            phases["experts"] -= per_expert * (len(layer.mlp.experts) - experts_touched)
    attn = model.model.layers[0].self_attn
    phases["kv"] = (2 * len(model.model.layers) * attn.num_kv_heads * attn.head_dim * _kv_element_size(model)
                    * context * BATCH)
    return phases


def phase_compute_s(config: Any, context: int, peaks: dict[str, str], rates: dict[str, float], dtype: str,
                    threads: int) -> dict[str, float]:
    """Each phase's multiply-adds at its kernel's peak, as ``compute_bound_s`` counts them, plus attention's scores
    and weighted values (the ``kv`` phase) at the float32 peak (float32 only); norms, rotary, routing, sampling
    and scheduling are left out."""
    hidden, head_dim, layers = config.hidden_size, config.head_dim, config.num_hidden_layers
    experts = getattr(config, "num_experts", 0)
    macs = {
        "attention": BATCH * layers * hidden * head_dim * (2 * config.num_attention_heads
                                                           + 2 * config.num_key_value_heads),
        "kv": BATCH * layers * config.num_attention_heads * head_dim * 2 * context,
        "router": BATCH * layers * hidden * experts,
        "experts": BATCH * layers * (config.num_experts_per_tok * 3 * hidden * config.moe_intermediate_size
                                     if experts else 3 * hidden * config.intermediate_size),
        "head": BATCH * hidden * config.vocab_size,
    }
    kinds = {"attention": "decoder", "kv": "router", "router": "router", "experts": "decoder", "head": "head"}
    return {phase: compute_bound_s({kinds[phase]: count}, peaks, rates, dtype, threads)
            for phase, count in macs.items()}


def phase_roofline_s(phase_bytes: dict[str, float], compute_s: dict[str, float], read_gbps: float) -> float:
    """The step's phases one after another, each at the larger of its bytes at ``read_gbps`` and its multiply-adds
    at its peak: a layer's experts wait for its attention, the head for the last layer, so one phase's spare
    bandwidth or spare arithmetic cannot serve another's. A lower bound of the step, at least
    ``max(memory bound, compute bound)``."""
    return sum(max(size / (read_gbps * 1e9), compute_s.get(phase, 0.0)) for phase, size in phase_bytes.items())


def crossover_gbps(phase_bytes: dict[str, float], compute_s: dict[str, float], factor: float = 1.5) -> float:
    """The read rate above which ``factor`` times the memory bound is below the phase roofline: a run measuring a
    faster rate sets a target no step can meet. ``factor * bytes = sum(max(bytes_i, compute_i * rate))`` has one
    root (the right side grows with the rate), found by bisection."""
    total = sum(phase_bytes.values())

    def excess(rate: float) -> float:
        return sum(max(size, compute_s.get(phase, 0.0) * rate * 1e9) for phase, size in phase_bytes.items()) \
            - factor * total

    low, high = 1e-3, 1e6
    if excess(high) < 0:
        return float("inf")
    for _ in range(200):
        middle = (low + high) / 2
        low, high = (middle, high) if excess(middle) < 0 else (low, middle)
    return high


def _peak_names(quantization: str | None, quantize_lm_head: bool = True) -> dict[str, str]:
    """The ``instruction_peaks`` loop bounding each kind of ``_macs_per_step``'s work on this CPU, as the engine
    dispatches it (float32 GEMMs on 256 or 512 bits, INT8/INT4 kernels on VNNI or AVX2)."""
    from pdserve.engine.layers.quant_kernels import load_quant_kernels
    from pdserve.engine.native import dispatch_flags

    flags = dispatch_flags()
    float_peak = "f32 avx512" if "avx512f" in flags else "f32 avx2"
    kernels = load_quant_kernels()
    vnni = kernels is not None and kernels.isa == "avx512_vnni"
    quantized = {"int8": "int8 vnni" if vnni else "int8 avx2", "int4": "int8 vnni" if vnni else "int4 avx2"}
    decoder = quantized[quantization] if quantization else float_peak
    return {
        "decoder": decoder,
        "router": float_peak,
        "head": (quantized["int8"] if quantization and quantize_lm_head else float_peak),
    }


def compute_bound_s(macs: dict[str, int], peaks: dict[str, str], rates: dict[str, float],
                    dtype: str, threads: int) -> float:
    """Seconds the step's multiply-adds take at least: each kind at its loop's rate (GMAC/s per core) times
    ``threads``. Float work is counted only in float32 (bf16 products' peak is not measured)."""
    total = 0.0
    for kind, count in macs.items():
        name = peaks[kind]
        if name not in rates or (name.startswith("f32") and dtype != "float32"):
            continue
        total += count / (rates[name] * 1e9 * threads)
    return total


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-layers", type=int, default=8)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--expert-width", type=int, default=384)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--quantization", default=None)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    from pdserve.engine import LLM

    options: dict[str, Any] = {"dtype": args.dtype, "num_kv_blocks": 512, "enable_prefix_caching": False}
    if args.quantization:
        options["quantization"] = args.quantization
    with tempfile.TemporaryDirectory() as folder:
        llms = {
            name: LLM(model=str(_write(Path(folder) / name, _config(name == "moe", args))), **options)
            for name in ("dense", "moe")
        }
        moe_layers = [layer.mlp for layer in llms["moe"].engine.model.model.layers]
        grouped = [moe.grouped for moe in moe_layers]
        runs = ("dense", "moe", "moe_each")
        best = {(name, batch): float("inf") for name in runs for batch in (1, BATCH)}
        _, read_before = measure_bandwidth_gbps(BANDWIDTH_BUFFER_BYTES, repeats=20)
        for _ in range(args.repeats):
            for batch in (1, BATCH):
                for name in runs:
                    for moe, calls in zip(moe_layers, grouped):
                        moe.grouped = None if name == "moe_each" else calls
                    llm = llms["dense" if name == "dense" else "moe"]
                    best[name, batch] = min(best[name, batch], _decode_step_s(llm, batch))
        for moe, calls in zip(moe_layers, grouped):
            moe.grouped = calls
        # One more batch-32 run, untimed, counting the experts each decode step's layers ran (its last
        # NEW_TOKENS steps: one token per sequence each).
        counter = _ExpertCounter(llms["moe"].engine.model)
        _decode_step_s(llms["moe"], BATCH)
        decode_counts = counter.per_step[-NEW_TOKENS * args.num_layers :]
        touched = sum(decode_counts) / len(decode_counts)
        _, read_after = measure_bandwidth_gbps(BANDWIDTH_BUFFER_BYTES, repeats=20)
        read_gbps = max(read_before, read_after)
        step_bytes = _bytes_per_step(llms["moe"].engine.model, touched, PROMPT_LEN + NEW_TOKENS // 2)
        bound_s = step_bytes / (read_gbps * 1e9)
        with tempfile.TemporaryDirectory() as peaks_folder:
            rates = instruction_peaks.measure(instruction_peaks.build(Path(peaks_folder)), repeats=3)
        macs = _macs_per_step(llms["moe"].engine.model.config, BATCH)
        peaks = _peak_names(args.quantization)
        phase_bytes = _phase_bytes(llms["moe"].engine.model, touched, PROMPT_LEN + NEW_TOKENS // 2)
        phase_compute = phase_compute_s(llms["moe"].engine.model.config, PROMPT_LEN + NEW_TOKENS // 2, peaks, rates,
                                        args.dtype, torch.get_num_threads())
        compute_s = compute_bound_s(macs, peaks, rates, args.dtype, torch.get_num_threads())
        dense_compute_s = compute_bound_s(_macs_per_step(llms["dense"].engine.model.config, BATCH), peaks, rates,
                                          args.dtype, torch.get_num_threads())
    setting = args.dtype + (f":{args.quantization}" if args.quantization else "")
    print(f"setting {setting}; {args.num_layers} layers, {args.experts} experts of {args.expert_width}, "
          f"top-{args.top_k}; threads {torch.get_num_threads()}")
    for batch in (1, BATCH):
        dense, moe = best["dense", batch] * 1e3, best["moe", batch] * 1e3
        each = best["moe_each", batch] * 1e3
        print(f"batch {batch:>2}: dense twin {dense:7.2f} ms, MoE {moe:7.2f} ms ({moe / dense:.2f}x the dense twin); "
              f"a call per expert {each:7.2f} ms ({each / moe:.2f}x)")
    print(f"batch {BATCH}: experts touched per MoE layer {touched:.1f} of {args.experts}; the step reads "
          f"{step_bytes / 1e6:.1f} MB at {read_gbps:.1f} GB/s: bound {bound_s * 1e3:.2f} ms; the MoE step is "
          f"{best['moe', BATCH] / bound_s:.2f}x its bound")
    rate_text = ", ".join(f"{kind} {count / 1e9:.3f} G at {peaks[kind]} {rates.get(peaks[kind], 0):.1f}"
                          for kind, count in macs.items())
    step_bound = max(bound_s, compute_s)
    print(f"batch {BATCH}: multiply-adds ({rate_text} GMAC/s per core): compute bound {compute_s * 1e3:.2f} ms "
          f"({compute_s / bound_s:.2f}x the memory bound); the MoE step is {best['moe', BATCH] / step_bound:.2f}x "
          f"the larger bound; the dense twin {best['dense', BATCH] / dense_compute_s:.2f}x its compute bound "
          f"({dense_compute_s * 1e3:.2f} ms)")
    roofline_s = phase_roofline_s(phase_bytes, phase_compute, read_gbps)
    phase_text = ", ".join(
        f"{phase} {max(size / (read_gbps * 1e9), phase_compute.get(phase, 0.0)) * 1e3:.2f}"
        for phase, size in phase_bytes.items()
    )
    target_s = 1.5 * bound_s
    print(f"batch {BATCH}: phases at the larger of their bytes and multiply-adds ({phase_text} ms): roofline "
          f"{roofline_s * 1e3:.2f} ms ({roofline_s / bound_s:.2f}x the memory bound); the 1.5x target "
          f"({target_s * 1e3:.2f} ms) asks for {roofline_s / target_s:.0%} of the roofline's rate over the whole "
          f"step, the MoE step runs at {roofline_s / best['moe', BATCH]:.0%}; at a read rate above "
          f"{crossover_gbps(phase_bytes, phase_compute):.1f} GB/s the target is below the roofline")

if __name__ == "__main__":
    main()
