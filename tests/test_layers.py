"""The package's layers: a module imports only from its own layer or those below it (the import
graph of `tests/test_imports.py`: top-level, function-level and type-only imports all count), so
an arrow up, such as a kernel importing a selector, fails here and not in a reader's head.
`docs/architecture.md` draws the same layers."""

from __future__ import annotations

from tests.test_imports import import_graph, module_files

# bottom first; a name is a package (with all its modules) or a module of the top package
LAYERS = (
    # no atskv imports but these: GQA attention maths, the learned features' columns, errors, paths, figures
    ("atskv.attention", "atskv.features", "atskv.errors", "atskv.paths", "atskv.figures"),
    ("atskv.kernels",),  # Triton kernels and their torch references
    ("atskv.budget", "atskv.learned_options", "atskv.models", "atskv.data"),
    ("atskv.slot_cache",),  # the cache layers a selector reads
    ("atskv.selectors",),
    ("atskv.runtime.reference",),  # atskv.sparse, atskv.tiered and their stores
    ("atskv.runtime",),  # atskv.generate (runtime.fast) over the reference's registration; the vLLM plugin
    ("atskv",),  # the public names (loaded on first use from the runtimes, slot cache and selectors)
    ("atskv.predictor",),
    ("atskv.eval",),
    ("atskv.rl",),
    ("atskv.cli",),
)
# the learned selector loads its predictor: these predictor modules (and their empty package) may
# be imported from the selectors and from the vLLM plugin's learned selector, and all they import
# in turn stays at or below the selectors (or in the predictor)
LOADED_BY_SELECTORS = ("atskv.predictor", "atskv.predictor.export", "atskv.predictor.model")
LOADING_PREDICTORS = ("atskv.selectors", "atskv.runtime.vllm.learned")


def layer_of(module: str) -> int:
    for level, names in enumerate(LAYERS):
        if any(module == name or (name != "atskv" and module.startswith(name + ".")) for name in names):
            return level
    raise AssertionError(f"{module} is in no layer of tests/test_layers.py")


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """'a -> b' for every import of a module from a layer above the importer's."""
    return sorted(
        f"{module} -> {target}"
        for module, targets in graph.items()
        for target in targets
        if layer_of(target) > layer_of(module)
        and not (module.startswith(LOADING_PREDICTORS) and target in LOADED_BY_SELECTORS)
    )


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo += graph.get(module, ())
    return seen


def test_the_checker_finds_an_arrow_up():
    graph = {
        "atskv.kernels.quest": {"atskv.selectors.base", "atskv.kernels.backend", "atskv.attention"},
        "atskv.slot_cache": {"atskv.selectors"},
        "atskv.predictor.collect": {"atskv.eval.generation", "atskv.runtime.reference.sparse"},
        "atskv.selectors.learned": {"atskv.predictor.export", "atskv.slot_cache"},
        "atskv.selectors.quest": {"atskv.predictor.collect"},
    }
    assert upward_imports(graph) == [
        "atskv.kernels.quest -> atskv.selectors.base",
        "atskv.predictor.collect -> atskv.eval.generation",
        "atskv.selectors.quest -> atskv.predictor.collect",
        "atskv.slot_cache -> atskv.selectors",
    ]


def test_no_module_imports_from_a_layer_above_its_own():
    modules = module_files()
    graph = import_graph(modules)
    assert {layer_of(module) for module in modules} == set(range(len(LAYERS)))  # every layer is real
    assert upward_imports(graph) == []


def test_what_the_selectors_load_of_the_predictor_stays_below_them():
    graph = import_graph(module_files())
    selectors = layer_of("atskv.selectors")
    above = {
        module
        for start in LOADED_BY_SELECTORS
        for module in reachable(graph, start)
        if layer_of(module) > selectors and layer_of(module) != layer_of("atskv.predictor")
    }
    assert above == set()
