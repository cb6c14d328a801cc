"""pytest: do not collect inside the fake roots.

Their trees copy sysfs, whose links lead back to their own ancestors (a device's
`device` link to its PCI function, the accel class entry inside it): walking them never
ends. They hold no tests.
"""

collect_ignore = ["roots"]
