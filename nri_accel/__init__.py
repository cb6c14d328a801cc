"""nri-accel: an NRI plugin that gives containers their hardware AI accelerators.

Owns nothing but the package version. Subpackages: ttrpc (protocol library, no
dependency on the rest), nri (NRI wire protocol and plugin stub), discover (the
node's Inventory), deviceplugin (kubelet device plugin); modules request, policy,
select, edits, engine (the pure hot path), plugin, config, log, cli, and __main__
(the process's entry: the `nri-accel` command, `python -m nri_accel`).
"""

__version__ = "0.1.0"
