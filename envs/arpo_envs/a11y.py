"""OSWorld's accessibility-tree XML as every environment writes it: the namespaces of its attributes.

OSWorld's VM server tags a node's states, attributes, geometry, value and actions with these
namespaces (`st:focused="true"`, `cp:screencoord="(x, y)"`, ...), and its tree tools read them
by these URIs. The local desktop (`desktop.atspi`, `desktop.windows`) and the simulated desktop
(`sim.desktop`) build their trees with them; importing this module registers the prefixes with
ElementTree, so a serialised tree spells them as OSWorld's does.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET

NS = {
    "st": "https://accessibility.ubuntu.example.org/ns/state",
    "attr": "https://accessibility.ubuntu.example.org/ns/attributes",
    "cp": "https://accessibility.ubuntu.example.org/ns/component",
    "val": "https://accessibility.ubuntu.example.org/ns/value",
    "act": "https://accessibility.ubuntu.example.org/ns/action",
}
"""Prefix -> namespace URI of OSWorld's accessibility tree."""
for _prefix, _uri in NS.items():
    ET.register_namespace(_prefix, _uri)
