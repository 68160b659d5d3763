"""Print pip constraints that pin every lower bound of pyproject.toml: ``name>=X`` becomes ``name==X``.

CI's oldest leg installs the project with them (``pip install -c FILE -e ".[dev]"``), so each ``>=`` the
project declares is a version the README's test command has passed on, not a guess.  The bounds are read
from the project's dependencies and its ``dev`` and ``compile`` extras; a requirement without a lower bound
stays free.  One exception, :data:`KEPT_NEWEST`, says why.

Run it with the dev environment's Python (it reads requirements with ``packaging``, which pytest brings):

    python .ci/oldest.py > constraints.txt
    python .ci/oldest.py --bound protobuf      # one package's lower bound (4.21.0)
"""

from __future__ import annotations

import sys
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement  # pytest's dependency: in every test venv

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

#: Lower bounds the test environment cannot hold, with the reason.
KEPT_NEWEST = {
    "protobuf": "grpcio-tools of the dev extra needs protobuf 7.35 or newer; the committed caffe_pb2.py on the "
                "older runtimes down to the bound is checked by tests/proto/runtime_check.py",
}

def lower_bounds(pyproject: Path) -> dict[str, str]:
    """``{name: version}`` of every ``>=`` in the dependencies and the dev and compile extras."""
    project = tomllib.loads(pyproject.read_text())["project"]
    requirements = list(project["dependencies"])
    for extra in ("dev", "compile"):
        requirements += project.get("optional-dependencies", {}).get(extra, [])
    bounds: dict[str, str] = {}
    for text in requirements:
        try:
            requirement = Requirement(text)
        except InvalidRequirement as exc:
            raise SystemExit(f"{pyproject}: cannot read the requirement {text!r} ({exc})") from None
        name = requirement.name.lower()
        for version in (spec.version for spec in requirement.specifier if spec.operator == ">="):
            if bounds.get(name, version) != version:
                raise SystemExit(f"{pyproject}: {name} has two lower bounds, {bounds[name]} and {version}")
            bounds[name] = version
    return bounds


def main(argv: list[str]) -> int:
    bounds = lower_bounds(Path(__file__).resolve().parents[1] / "pyproject.toml")
    if argv[:1] == ["--bound"] and len(argv) == 2:
        if argv[1].lower() not in bounds:
            raise SystemExit(f"pyproject.toml gives {argv[1]} no lower bound")
        print(bounds[argv[1].lower()])
        return 0
    if argv:
        raise SystemExit("usage: oldest.py [--bound NAME]")
    for name, version in sorted(bounds.items()):
        if name in KEPT_NEWEST:
            print(f"# {name}>={version} not pinned: {KEPT_NEWEST[name]}")
        else:
            print(f"{name}=={version}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
