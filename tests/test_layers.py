"""The SDK's layout: layers import only downwards, no import circle, and nothing in it knows the adapter."""

from __future__ import annotations

import ast
from pathlib import Path

SDK = Path(__file__).resolve().parent.parent / "rlhfless_sdk"
#: Lowest first: a module may import from its own layer and the ones before it.
LAYERS = ["api", "workloads", "planning", "rollout", "simulation", "cli"]


def module_name(path: Path) -> str:
    parts = path.relative_to(SDK.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in SDK.rglob("*.py")}


def sdk_imports(path: Path, known: set[str]) -> set[str]:
    """Every rlhfless_sdk module ``path`` imports, at top level or inside functions (TYPE_CHECKING blocks too)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("rlhfless_sdk")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("rlhfless_sdk"):
            for a in node.names:  # ``from rlhfless_sdk.api import hookspecs`` imports a module
                sub = f"{node.module}.{a.name}"
                out.add(sub if sub in known else node.module)
    return out


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {m: sdk_imports(p, set(mods)) - {m} for m, p in mods.items()}


def layer(module: str) -> int | None:
    if module == "rlhfless_sdk":  # the package facade re-exports the api layer only
        return 0
    parts = module.split(".")
    return LAYERS.index(parts[1]) if len(parts) > 1 and parts[1] in LAYERS else None


def test_every_sdk_module_sits_in_a_layer():
    loose = [m for m in modules() if layer(m) is None and m not in ("rlhfless_sdk", "rlhfless_sdk.__main__")]
    assert loose == []


def test_layers_import_only_downwards():
    wrong = []
    for mod, deps in graph().items():
        here = layer(mod)
        if here is None:
            continue
        wrong += [(mod, d) for d in deps if layer(d) is None or layer(d) > here]  # type: ignore[operator]
    assert wrong == []


def assert_no_circle(g: dict[str, set[str]]) -> None:
    """Raise, naming it, on the first import circle of the module graph ``g`` (a depth-first walk)."""
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for d in sorted(g.get(m, ())):
            if state.get(d) == 1:
                raise AssertionError("import circle: " + " -> ".join([*path[path.index(d) :], d]))
            if d not in state:
                visit(d, [*path, d])
        state[m] = 2

    for m in sorted(g):
        if m not in state:
            visit(m, [m])


def test_no_import_circle():
    assert_no_circle(graph())


def test_the_sdk_never_names_the_adapter():
    hits = [str(p) for p in SDK.rglob("*.py") if "rlhfless_openrlhf" in p.read_text(encoding="utf-8")]
    assert hits == []


def test_the_sdk_and_its_cli_import_nothing_heavy():
    """Importing the SDK, building the registry (which loads the adapter's command plugin) and the CLI pulls in
    no torch, Ray, vLLM or OpenRLHF: they load only when a command that needs them runs."""
    import subprocess
    import sys

    code = (
        "import sys, rlhfless_sdk, rlhfless_sdk.cli.main as m\n"
        "from rlhfless_sdk import get_plugin_manager\n"
        "assert 'demo' in get_plugin_manager().registry.commands\n"
        "print(sorted({n.split('.')[0] for n in sys.modules} & {'torch', 'ray', 'vllm', 'openrlhf', 'transformers'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_adapter_imports_no_cli_and_the_api_names_no_framework():
    """The OpenRLHF adapter uses the SDK's api, planning and rollout layers, never its command line; the api layer
    (what every plugin and backend sees) names no training framework, so a second adapter fits beside OpenRLHF's."""
    adapters = SDK.parent / "adapters"
    cli = [str(p) for p in adapters.rglob("*.py") if "rlhfless_sdk.cli" in p.read_text(encoding="utf-8")]
    assert cli == []
    named = [
        f"{p.name}:{i}"
        for p in (SDK / "api").rglob("*.py")
        for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
        if "openrlhf" in line.lower()
    ]
    assert named == []


def test_the_mode_is_decided_in_one_place():
    """How a scheduler's steps run is decided by ``rlhfless_sdk.rollout.modes`` alone: no other source file of the
    SDK, the policies or the adapter reads the pipeline's mode or tail fields, or probes a straggler policy's
    capabilities, to pick a loop (``api/config.py`` defines and validates the fields, ``api/plugins.py`` checks the
    pipeline's name is registered)."""
    import re

    root = SDK.parent
    decides = re.compile(
        r"(?<![\"'`\w])pipeline\.(mode|pipelined|elastic|tail_prepare|tail_learn)\b"  # code, not a message's words
        r"|\[\"pipeline\"\]\[\"mode\"\]|pipeline\.get\(\"mode\"\)"
        r"|isinstance\([^)]*(OverProvisioning|KeepsCutTokens)"
    )
    allowed = {SDK / "rollout" / "modes.py", SDK / "api" / "config.py", SDK / "api" / "plugins.py"}
    hits = [
        f"{p.relative_to(root)}:{i}: {line.strip()}"
        for folder in (SDK, root / "policies", root / "adapters")
        for p in folder.rglob("*.py")
        if p not in allowed
        for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
        if decides.search(line)
    ]
    assert hits == []


def test_the_streams_decisions_are_made_in_one_place():
    """The stream's book (admission, finishes, batches) is driven by ``rlhfless_sdk.rollout.stream_loop`` alone:
    the simulator's loop and the adapter's ``EngineStream`` go through its ``StreamLoop``."""
    import re

    root = SDK.parent
    decides = re.compile(r"\.(take|finish|form|may_start)\(")
    allowed = {SDK / "rollout" / "stream_loop.py", SDK / "rollout" / "stream_book.py"}
    hits = [
        f"{p.relative_to(root)}:{i}: {line.strip()}"
        for folder in (SDK / "rollout", SDK / "simulation", root / "adapters")
        for p in folder.rglob("*.py")
        if p not in allowed
        for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
        if decides.search(line) and "book" in line
    ]
    assert hits == []
    assert "StreamLoop(" in (SDK / "rollout" / "stream.py").read_text(encoding="utf-8")
    assert "StreamLoop(" in (root / "adapters" / "openrlhf" / "stream.py").read_text(encoding="utf-8")


def test_the_adapters_production_path_imports_no_simulator():
    """The OpenRLHF adapter's production path (the launcher, the samples generator, the Ray backend, the engine and
    trainer classes) imports nothing from the SDK's simulation layer; only its tools (``adapters/openrlhf/tools/``:
    the demos, the fidelity check, the profiler), which compare real engines with the simulator, do, and the split
    planner the launcher runs once before Ray starts (``launch_split.py``: the split of a stream, picked by
    simulating the user's trace at each split), which imports the simulator and the split search only."""
    adapter = SDK.parent / "adapters" / "openrlhf"
    production = [p for p in adapter.rglob("*.py") if "tools" not in p.relative_to(adapter).parts]
    assert {p.name for p in production} >= {"train_ppo_ray.py", "generator.py", "ray_backend.py", "engine_actor.py"}
    known = set(modules())
    wrong = [
        f"{p.relative_to(adapter)}: {m}"
        for p in production
        for m in sorted(sdk_imports(p, known))
        if m.startswith("rlhfless_sdk.simulation") or m.startswith("rlhfless_sdk.cli")
    ]
    planner = {"launch_split.py: rlhfless_sdk.simulation.simulator", "launch_split.py: rlhfless_sdk.simulation.split"}
    assert set(wrong) == planner
    tools = {p.name for p in (adapter / "tools").glob("*.py")}
    assert {"demo.py", "fidelity.py", "vllm_profile.py", "pipeline_demo.py", "cli.py"} <= tools


# -- the adapter's own layers ----------------------------------------------------------------------------------
ADAPTER = SDK.parent / "adapters" / "openrlhf"
#: Lowest first: what the launch and the actors stand on; the engines; the samples generator; the launch; the tools.
ADAPTER_LAYERS: list[tuple[str, set[str]]] = [
    (
        "foundations",
        {
            "capabilities",
            "carried",
            "cpu",
            "drafting",
            "flash_attn_placeholder",
            "launch_split",
            "learner_fixes",
            "messages",
            "plan",
            "profile_fit",
            "reaper",
            "requirements",
        },
    ),
    ("engines", {"engine_actor", "engine_factory", "fill", "ray_backend"}),
    ("generator", {"generator", "rollout_actor", "step_io", "run_modes", "stream"}),
    ("launch", {"decide", "internals", "launch", "train_ppo_ray", "trainer"}),
]


def adapter_modules() -> dict[str, Path]:
    """The adapter's modules by their name under ``rlhfless_openrlhf`` (``tools.demo`` for a tool)."""
    out = {p.stem: p for p in ADAPTER.glob("*.py") if p.stem != "__init__"}
    out |= {f"tools.{p.stem}": p for p in (ADAPTER / "tools").glob("*.py") if p.stem != "__init__"}
    return out


def adapter_imports(path: Path, known: set[str]) -> set[str]:
    """Every adapter module ``path`` imports (``from rlhfless_openrlhf import fill`` too), TYPE_CHECKING blocks too."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
        for name in names:
            sub = name.removeprefix("rlhfless_openrlhf").lstrip(".")
            if name.startswith("rlhfless_openrlhf") and sub in known:
                out.add(sub)
    return out


def adapter_layer(module: str) -> int:
    if module.startswith("tools."):
        return len(ADAPTER_LAYERS)
    return next(i for i, (_, members) in enumerate(ADAPTER_LAYERS) if module in members)


def test_every_adapter_module_sits_in_a_layer_and_imports_only_downwards_without_a_circle():
    mods = adapter_modules()
    listed = set().union(*(members for _, members in ADAPTER_LAYERS))
    assert sorted(m for m in mods if not m.startswith("tools.") and m not in listed) == []
    assert sorted(listed - set(mods)) == []
    graph = {m: adapter_imports(p, set(mods)) - {m} for m, p in mods.items()}
    upward = [(m, d) for m, deps in graph.items() for d in deps if adapter_layer(d) > adapter_layer(m)]
    assert upward == []
    assert_no_circle(graph)


def test_the_adapters_docstring_names_each_of_its_modules():
    """The package docstring is the adapter's map: every module is named in it, and every name it gives as a
    module (a double-backquoted lower-case word matching no module is not one) exists."""
    import re

    doc = ast.get_docstring(ast.parse((ADAPTER / "__init__.py").read_text(encoding="utf-8"))) or ""
    named = set(re.findall(r"``([a-z_]+)``", doc))
    mods = {m for m in adapter_modules() if not m.startswith("tools.")} | {"tools"}
    assert sorted(mods - named) == []
