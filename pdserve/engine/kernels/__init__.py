"""The engine's CPU kernels: C sources, their torch operators (``ops.cpp``), and the library ``_C`` that
``setup.py`` builds from them, every ISA variant in one. ``pdserve.engine.native`` loads it."""
