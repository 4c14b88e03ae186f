"""setup.py lists every package of the source tree, so a non-editable install has all of them."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def setup_packages() -> tuple[set[str], dict[str, str]]:
    call = next(node for node in ast.walk(ast.parse((ROOT / "setup.py").read_text()))
                if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "setup")
    kwargs = {k.arg: ast.literal_eval(k.value) for k in call.keywords if k.arg in ("packages", "package_dir")}
    return set(kwargs["packages"]), kwargs["package_dir"]


def test_every_package_folder_is_installed():
    packages, dirs = setup_packages()
    found = set()
    for name, folder in dirs.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            relative = init.parent.relative_to(ROOT / folder).parts
            found.add(".".join((name, *relative)))
    assert found - packages == set(), "add these to setup.py's packages"
    assert packages - found == set(), "setup.py lists packages that do not exist"
