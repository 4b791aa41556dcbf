"""What one ``pdserve bench`` invocation does, and parsing of its compound options."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from pdserve.bench.metrics import SLOs
from pdserve.bench.runner import RunConfig, SamplingConfig
from pdserve.bench.workload import WorkloadConfig

if TYPE_CHECKING:
    from pdserve.service_common.security import TlsConfig

BACKENDS = ("grpc", "http")  # pdserve.v1.Generation; the OpenAI HTTP API (/v1/completions)
SLO_KEYS = {"ttft": "ttft_ms", "tpot": "tpot_ms", "e2el": "e2el_ms"}


@dataclass(frozen=True)
class BenchConfig:
    """A benchmark: the server, the workload, each run's request rate, SLOs and where results go."""

    workload: WorkloadConfig
    backend: str = "grpc"
    target: str = "127.0.0.1:50051"
    tls: TlsConfig | None = None  # of the connection to the target; None: plaintext
    request_rates: tuple[float, ...] = (math.inf,)  # one run per rate, in order, on the same workload
    burstiness: float = 1.0
    max_concurrency: int | None = None
    warmup: int = 0
    slos: SLOs = field(default_factory=SLOs)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    result_json: Path | None = None
    plot_dir: Path | None = None
    show_progress: bool = True

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"unknown backend {self.backend!r}; choose one of {', '.join(BACKENDS)}")
        if not self.request_rates:
            raise ValueError("give at least one request rate")
        for rate in self.request_rates:
            if not rate > 0:
                raise ValueError(f"request rates must be positive (or inf), got {rate}")
        if not (self.burstiness > 0 and math.isfinite(self.burstiness)):
            raise ValueError(f"--burstiness must be a positive finite number, got {self.burstiness}")
        if self.warmup < 0:
            raise ValueError(f"--warmup must be >= 0, got {self.warmup}")
        if not self.sampling.timeout_s > 0:
            raise ValueError(f"--request-timeout must be positive, got {self.sampling.timeout_s}")

    def run_config(self, request_rate: float, request_id_prefix: str, description: str = "") -> RunConfig:
        return RunConfig(
            request_rate=request_rate,
            burstiness=self.burstiness,
            max_concurrency=self.max_concurrency,
            seed=self.workload.seed,
            sampling=self.sampling,
            request_id_prefix=request_id_prefix,
            show_progress=self.show_progress,
            description=description,
        )


def parse_rate(text: str) -> float:
    """A request rate: a positive number of requests per second, or ``inf``."""
    try:
        rate = float(text)
    except ValueError:
        raise ValueError(f"a request rate must be a number or inf, got {text!r}") from None
    if not rate > 0:
        raise ValueError(f"a request rate must be positive (or inf), got {text!r}")
    return rate


def parse_rates(text: str) -> tuple[float, ...]:
    """``--sweep 1,2,4,inf``: the rates of the runs, in order."""
    parts = [part.strip() for part in text.split(",")]
    if not all(parts):
        raise ValueError(f"--sweep takes comma-separated rates such as 1,2,4,inf, got {text!r}")
    return tuple(parse_rate(part) for part in parts)


def parse_mix(text: str) -> tuple[float, float, float]:
    """``--mix 0.6,0.2,0.2``: the mixed workload's weights of chat turns, long documents and shared prefixes."""
    parts = [part.strip() for part in text.split(",")]
    try:
        weights = tuple(float(part) for part in parts)
    except ValueError:
        weights = ()
    if len(weights) != 3 or any(not math.isfinite(w) or w < 0 for w in weights) or not sum(weights) > 0:
        raise ValueError(f"--mix takes three non-negative weights CHAT,LONG,PREFIX such as 0.6,0.2,0.2, got {text!r}")
    return weights  # type: ignore[return-value]


def parse_slos(items: Sequence[str]) -> SLOs:
    """``--goodput ttft:500 tpot:50 e2el:2000`` (any subset, milliseconds)."""
    values: dict[str, float] = {}
    for item in items:
        key, sep, value = item.partition(":")
        if not sep or key not in SLO_KEYS:
            raise ValueError(f"--goodput takes KEY:MS with KEY one of {', '.join(SLO_KEYS)}, got {item!r}")
        if SLO_KEYS[key] in values:
            raise ValueError(f"--goodput gives {key} twice")
        try:
            values[SLO_KEYS[key]] = float(value)
        except ValueError:
            raise ValueError(f"--goodput {key} needs a number of milliseconds, got {value!r}") from None
    return SLOs(**values)


def rate_label(rate: float) -> str:
    """``inf`` or the rate as written (``20``, ``0.5``): in file names, tables and JSON."""
    return "inf" if math.isinf(rate) else f"{rate:g}"
