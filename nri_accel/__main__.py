"""The process's entry: the `nri-accel` command (console script) and `python -m nri_accel`.

Owns what only a process's first lines can do for its start-up (issue #10: `run`, from
exec to registered with the runtime; bench_instructions.py prints it), before
nri_accel.cli and the verb's modules load (together: 544 -> 502 M instructions from
exec to registered):
- asyncio is imported with the ssl module hidden. asyncio imports ssl, when it can, to
  offer TLS, which nri-accel never speaks (NRI's socket, the kubelet's gRPC and /metrics
  are plain sockets): loading OpenSSL and building ssl's enums is ~25 M instructions,
  5 % of the start. asyncio then works as on a Python built without ssl; ssl itself is
  importable again at once (prometheus_client, for one, imports it, and so does uvloop,
  which `run` starts its event loop on by default: App.run_loop).
- the cyclic garbage collector is off while the modules load: imports build some 40,000
  objects it tracks (`run`'s) and free none, and it would walk them again and again
  (the young ones every 700 allocations, all of them each time they grow by a quarter):
  ~22 M instructions. Once the verb's module is imported (cli.main's `imported`), what
  they built is frozen out of its sight (gc.freeze: it lives as long as the process)
  and the collector is on again.

Anything that runs cli.main in a process of its own (tests, the demo) goes through here
too: `python -m nri_accel VERB ...`.
"""

import gc
import sys

gc.disable()
_HIDDEN = sys.modules.setdefault("ssl", None) is None  # False: ssl was imported before
import asyncio  # noqa: E402, F401  (first, without ssl: see above)

if _HIDDEN:
    del sys.modules["ssl"]

from nri_accel import cli  # noqa: E402


def _started() -> None:
    gc.freeze()
    gc.enable()


def main() -> int:
    return cli.main(imported=_started)


if __name__ == "__main__":
    sys.exit(main())
