"""The native CPU kernels: the plain C sources in this folder (*.c, *.h), and what builds, loads and chooses them.

`loader` compiles a source at first use for the active instruction-set level (`cpu_isa`) and loads it with ctypes
(`trust`: only libraries it built itself), `prototypes` types the functions from their C declarations, `prebuild`
builds libraries ahead on threads, `env_settings` holds the settings read at each call, `dispatch` measures per
shape class whether the native kernel or the torch path runs, and `call_plans` keeps that decision per signature.
"""
