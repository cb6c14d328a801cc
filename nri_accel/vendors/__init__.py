"""Vendor profiles: one module per accelerator family.

Owns nothing yet but its modules: gaudi (Intel Gaudi, habanalabs driver) and amd (AMD
Instinct, amdgpu/KFD), each with the function-level API discover(root), parse_visible(),
container_env() and probe(root); _common holds the sysfs/procfs readers they share.
Imports nothing itself. (Placeholder: the profile registry replaces this docstring.)
"""
