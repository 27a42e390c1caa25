"""Fails when a set of Python packages holds torch, naming the packages that ask for it.

    python .ci/check_no_torch.py PACKAGES.json LABEL

PACKAGES.json is what pip resolved (`pip install --dry-run --report`) or what a venv holds
(`pip inspect`); LABEL names it in the messages.
"""

from __future__ import annotations

import json
import sys

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name


def torch_requirements(package: dict) -> list[Requirement]:
    """The package's requirements of torch, whatever their markers."""
    found = []
    for line in package["metadata"].get("requires_dist", []):
        try:
            requirement = Requirement(line)
        except InvalidRequirement:
            continue
        if canonicalize_name(requirement.name) == "torch":
            found.append(requirement)
    return found


def asks_for_torch(package: dict) -> bool:
    """Whether it requires torch with the extras it was asked for (a report's requested packages only)."""
    extras = package.get("requested_extras") or [""]
    return any(r.marker is None or any(r.marker.evaluate({"extra": e}) for e in extras)
               for r in torch_requirements(package))


def main(path: str, label: str) -> int:
    with open(path) as file:
        document = json.load(file)
    packages = document.get("install", document.get("installed", []))
    torch = [p for p in packages if canonicalize_name(p["metadata"]["name"]) == "torch"]
    if not torch:
        print(f"{label}: no torch among its {len(packages)} packages")
        return 0
    askers = [p["metadata"]["name"] for p in packages if asks_for_torch(p)]
    if not askers:  # pip inspect does not say which extras were asked for: every package that may
        askers = [f"{p['metadata']['name']} (under a marker)" for p in packages if torch_requirements(p)]
    version = torch[0]["metadata"]["version"]
    print(f"{label}: holds torch {version}, asked for by {', '.join(sorted(askers)) or 'nothing named'}",
          file=sys.stderr)
    return 1


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    sys.exit(main(sys.argv[1], sys.argv[2]))
