"""`nri-accel check`: validate the configuration and the node before `run`.

Owns: the checks and their report. Imports nri_accel.app and the standard library.
Prints one line per finding, "ok:", "warn:" or "error:" first; exit status 0 when `run`
would work (warnings allowed), 1 otherwise (2 for an invalid configuration, as with
every verb). Used by the systemd unit's
ExecStartPre so a broken configuration fails at start with a readable reason.
"""

from __future__ import annotations

import argparse
import os
import socket
import stat

from nri_accel.app import REPORT, App


def _socket_finding(path: str) -> tuple[str, str]:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return "warn", (f"NRI socket {path} does not exist yet: is NRI enabled in the "
                        "runtime (deploy/containerd, deploy/crio)? `run` keeps retrying")
    except OSError as e:
        return "error", f"NRI socket {path}: {e.strerror}"
    if not stat.S_ISSOCK(st.st_mode):
        return "error", f"{path} is not a unix socket"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(1.0)
    try:
        s.connect(path)
    except OSError as e:
        return "warn", f"NRI socket {path} refuses connections ({e.strerror}): runtime down?"
    finally:
        s.close()
    return "ok", f"NRI socket {path} accepts connections"


def main_check(args: argparse.Namespace) -> int:
    app = App.from_args(args, mode=REPORT)
    config = app.config
    findings: list[tuple[str, str]] = [
        ("ok", f"configuration {config.path or '(built-in defaults)'}: "
               f"policy {config.policy.mode}"),
    ]
    inventory = app.load_inventory()
    kinds = {}
    for d in inventory.devices:
        kinds[d.kind] = kinds.get(d.kind, 0) + 1
    if kinds:
        findings.append(("ok", "devices: " + ", ".join(f"{n} {k}" for k, n in kinds.items())))
    else:
        findings.append(("warn", "no accelerator devices found on this node"))
    findings += [("warn", f"{p.source}: {p.message}") for p in inventory.problems]
    findings.append(_socket_finding(args.socket or config.nri.socket))
    for level, text in findings:
        print(f"{level}: {text}")
    return 1 if any(level == "error" for level, _ in findings) else 0
