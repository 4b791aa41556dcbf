"""Tuning for workers that share their machine's cores: one optional component the engine knows nothing of.

Where a prefill and a decode worker (or several) compute on the same few
cores, how each process waits and how much of the CPU it claims decides their
throughput more than any kernel. Everything for that lives here:

- ``openmp``: one OpenMP pool per process (``on_a_passing_thread`` loads the
  model on a thread that ends), and ``SpinGovernor``, which lets libgomp's
  threads spin only while the other processes leave this one's CPUs idle
  (a worker's ``--openmp-spin adaptive``);
- ``niceness``: a worker's ``--niceness`` (``pdserve up --prefill-niceness``).

The engine exposes only generic hooks that this component plugs into
(``LLMEngine.between_layers``, ``AsyncEngine``'s ``before_work``); the worker
runtime (``pdserve.service_common.worker``) wires them. Nothing here is
needed for the engine to run.
"""
