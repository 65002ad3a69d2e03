"""Every collective's type rule against the distributed mesh's results (importable by spawned ranks)."""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import shmap  # noqa: E402
from rule_cases import rule_mismatches  # noqa: E402


def run():
    return rule_mismatches(shmap.make_mesh((2, 2), ("i", "j")))
