"""Fault injection for end-to-end tests, loaded only when a test puts this folder on a child's PYTHONPATH.

With ``PDSERVE_TEST_ENGINE_FAULT_DIR`` set, ``LLMEngine.step`` raises in a
process once a file named after that process's PID exists in the folder: its
engine thread dies as it would on a real bug, while the process lives on.
Nothing is imported until the engine module itself is, so processes without
an engine (the gateway, ``pdserve up``) stay as they are.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys

_FAULT_DIR = os.environ.get("PDSERVE_TEST_ENGINE_FAULT_DIR")


def _patch(engine_class: type) -> None:
    step = engine_class.step

    def step_or_fail(self):  # noqa: ANN001, ANN202 - same signature as LLMEngine.step
        if os.path.exists(os.path.join(_FAULT_DIR, str(os.getpid()))):
            raise RuntimeError("injected engine failure (tests/e2e/faults)")
        return step(self)

    engine_class.step = step_or_fail


class _PatchEngineOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):  # noqa: ANN001, ANN201 - the finder protocol
        if name != "pdserve.engine.llm_engine":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        loader_exec = spec.loader.exec_module

        def exec_module(module):  # noqa: ANN001, ANN202
            loader_exec(module)
            _patch(module.LLMEngine)

        spec.loader.exec_module = exec_module
        return spec


if _FAULT_DIR:
    sys.meta_path.insert(0, _PatchEngineOnImport())
