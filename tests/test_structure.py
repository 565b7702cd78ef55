"""The shape of the house: static imports, each parallelism's plain algorithm within a reader's budget with its
optional layers beside it, arrows that point one way, a repository that explains itself, and a README that fits its
purpose."""
import ast
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def tracked(pattern):
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", pattern], cwd=REPO,
                         capture_output=True, text=True, check=True).stdout.split()
    return sorted(REPO / p for p in out if (REPO / p).exists())


PYTHON = tracked("*.py")


def imported_modules(path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            yield node.module
            yield from (f"{node.module}.{alias.name}" for alias in node.names)


def test_the_source_files_are_found():
    names = {p.relative_to(REPO).as_posix() for p in PYTHON}
    assert {"train.py", "model.py", "parallel/fsdp.py", "data/saves.py", "tests/test_structure.py"} <= names


@pytest.mark.parametrize("path", PYTHON, ids=lambda p: p.relative_to(REPO).as_posix())
def test_imports_are_static_and_at_the_top(path):
    tree = ast.parse(path.read_text())
    dynamic = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Call) and (
        (isinstance(n.func, ast.Attribute) and n.func.attr == "import_module")
        or (isinstance(n.func, ast.Name) and n.func.id in ("__import__", "import_module")))]
    assert not dynamic, f"dynamic imports at lines {dynamic}"
    top_level = {id(n) for n in tree.body}
    buried = [n.lineno for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
              and id(n) not in top_level and not _is_version_fallback(tree, n)]
    assert not buried, f"imports inside functions or blocks at lines {buried}"


def _is_version_fallback(tree, node):
    """`try: from new.place import x / except ImportError: from old.place import x` at module level."""
    for stmt in tree.body:
        if isinstance(stmt, ast.Try) and any(node is n for n in ast.walk(stmt)):
            return any(isinstance(h.type, ast.Name) and h.type.id == "ImportError" for h in stmt.handlers)
    return False


PLAIN = {  # each parallelism: the file holding its plain algorithm, what a reader reads to understand it
    "DDP": "parallel/ddp.py", "FSDP": "parallel/fsdp.py", "HSDP (on FSDP)": "parallel/hsdp.py",
    "tensor parallel": "parallel/tp.py", "pipeline parallel": "parallel/pp.py",
    "context parallel": "parallel/cp.py", "activation checkpointing": "parallel/ckpt.py",
}
LAYERS = ("parallel/tp_overlap.py", "parallel/pp_bw_split.py", "parallel/fsdp_accumulate.py",
          "parallel/compiled.py", "parallel/fp8.py")  # each switched in by a flag or a mode
BUDGET = {"FSDP": 345, "pipeline parallel": 305}  # lines a reader reads for one parallelism's plain path: 300;
# FSDP's unit (a flat buffer cut into shards), gather-and-free with its prefetch both ways, the reduce-scatter, and the
# shard-to-global map that saves and the gradient norm read; the pipeline's timing of its bubble
PAGES_BUDGET = 1450  # the seven pages together


def plain_lines(path):
    return len((REPO / path).read_text().splitlines())


@pytest.mark.parametrize("concept", list(PLAIN))
def test_each_parallelism_reads_in_one_file_within_the_budget(concept):
    n, budget = plain_lines(PLAIN[concept]), BUDGET.get(concept, 300)
    assert n <= budget, f"{PLAIN[concept]}: {n} lines of plain path > {budget}"


def test_the_seven_pages_together_fit_the_budget():
    n = sum(map(plain_lines, PLAIN.values()))
    assert n <= PAGES_BUDGET, f"the seven pages: {n} lines > {PAGES_BUDGET}"


@pytest.mark.parametrize("path", list(PLAIN.values()))
def test_a_plain_file_needs_no_optional_layer(path):
    layers = {p.removesuffix(".py").replace("/", ".") for p in LAYERS} | {"parallel." + p.split("/")[-1][:-3]
                                                                         for p in LAYERS}
    used = set(imported_modules(REPO / path))
    assert not used & layers, f"{path} imports {used & layers}"


def test_the_model_imports_no_parallel_or_save_module():
    bad = [m for m in imported_modules(REPO / "model.py") if m.split(".")[0] in ("parallel", "saves", "train",
                                                                                    "config", "optim")]
    assert not bad, bad


def test_parallel_modules_take_explicit_arguments_not_the_command_line():
    for path in tracked("parallel/*.py"):
        text = path.read_text()
        assert not re.search(r"\bargs\.\w", text), f"{path.name} reads the argparse namespace"
        assert "argparse" not in set(imported_modules(path)), path.name


def test_nothing_cites_a_document_outside_the_repository():
    names = ["DES" + "IGN", "MIS" + "SION"]  # spelled apart, so that this file does not cite them itself
    pattern = re.compile("|".join([rf"\b{n}\b" for n in names] + [r"\.\./shared", "seed " + "notes"]))
    texts = PYTHON + tracked("*.md") + tracked("Makefile") + tracked("*.sbatch")
    cited = [f"{p.relative_to(REPO)}:{i}" for p in texts for i, line in enumerate(p.read_text().splitlines(), 1)
             if pattern.search(line)]
    assert not cited, cited


def test_the_readmes_are_a_map_not_a_wall():
    """The front door fits its purpose: about 250 lines, none over 120 characters (here and in bench/README.md)."""
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines"
    for readme in (REPO / "README.md", REPO / "bench" / "README.md"):
        long = [i for i, line in enumerate(readme.read_text().splitlines(), 1) if len(line) > 120]
        assert not long, f"{readme.relative_to(REPO)}: lines over 120 characters: {long[:10]}"


def test_links_in_the_readmes_point_to_files_that_exist():
    for readme in (REPO / "README.md", REPO / "bench" / "README.md"):
        for target in re.findall(r"\]\(([^)#\s]+)", readme.read_text()):
            if "://" not in target:
                assert (readme.parent / target).exists(), f"{readme.relative_to(REPO)} links to missing {target}"


TORCH_APIS = {  # what the code calls -> the first torch release that has it as used
    "enable_gqa=": (2, 5),  # F.scaled_dot_product_attention with grouped-query K/V
    "torch._scaled_mm(": (2, 5),  # returns one tensor (2.4: a tuple with the amax)
    "F.rms_norm(": (2, 4),
    "torch.get_autocast_dtype(": (2, 4),
    "register_post_accumulate_grad_hook(": (2, 1),
}


def test_the_torch_floor_is_the_oldest_release_with_every_api_the_code_uses():
    line = next(r for r in (REPO / "requirements.txt").read_text().splitlines() if r.startswith("torch>="))
    floor = tuple(int(x) for x in line.split(">=")[1].split()[0].split(".")[:2])
    code = "".join(p.read_text() for p in PYTHON if not p.relative_to(REPO).as_posix().startswith("tests/"))
    used = {api: version for api, version in TORCH_APIS.items() if api in code}
    assert used and floor == max(used.values()), (floor, used)


def test_launchers_call_python_modules_not_console_scripts_the_venv_may_not_own():
    """A venv made with --system-site-packages over an image's torch has no bin/torchrun (nor pytest, ruff, when the
    image brings them): the Makefile and train.sbatch call `python -m` for each."""
    for name in ("Makefile", "bench/cluster/train.sbatch"):
        lines = [line for line in (REPO / name).read_text().splitlines() if not line.lstrip().startswith("#")]
        for script in ("torchrun", "pytest", "ruff"):
            called = [line for line in lines if re.search(rf"(bin/|^\s*|&&\s*){script}\b", line)]
            assert not called, f"{name} calls the {script} script: {called}"
    assert "-m parallel.launch" in (REPO / "Makefile").read_text()
    assert "-m parallel.launch" in (REPO / "bench" / "cluster" / "train.sbatch").read_text()


ENTRY_BUDGET = {"train.py": 450, "model.py": 430, "config.py": 320, "sample.py": 200}  # a reader holds each in mind


@pytest.mark.parametrize("path", list(ENTRY_BUDGET))
def test_the_entry_files_fit_in_a_readers_head(path):
    n = len((REPO / path).read_text().splitlines())
    assert n <= ENTRY_BUDGET[path], f"{path}: {n} lines > {ENTRY_BUDGET[path]}"


TOP_LEVEL = {"train.py", "model.py", "config.py", "sample.py"}


def test_the_top_level_holds_only_files_a_reader_looks_for_by_name():
    found = {p.name for p in PYTHON if p.parent == REPO}
    assert found <= TOP_LEVEL, f"new top-level files: {sorted(found - TOP_LEVEL)}"


def folder_imports():
    """{top-level folder: the top-level folders its files import}, tests excluded."""
    folders = {p.name for p in REPO.iterdir() if (p / "__init__.py").exists()} - {"tests"}
    arrows = {f: set() for f in folders}
    for path in PYTHON:
        rel = path.relative_to(REPO).parts
        if rel[0] in folders:
            arrows[rel[0]] |= {m.split(".")[0] for m in imported_modules(path) if m} & folders - {rel[0]}
    return arrows


def test_no_folder_imports_a_folder_that_imports_it_back():
    arrows = folder_imports()
    assert "parallel" in arrows and "data" in arrows, arrows
    back = sorted((a, b) for a in arrows for b in arrows[a] if a in arrows.get(b, ()))
    assert not back, f"folders that import each other: {back}"


ROOMS = {  # each room, and the rooms it may import: one way, bench on top and model.py at the ground
    "model": set(), "parallel": {"model"}, "data": {"model", "parallel"},
    "config": {"model", "parallel", "data"}, "train": {"config", "model", "parallel", "data"},
    "sample": {"config", "model", "parallel", "data", "train"},
    "bench": {"config", "model", "parallel", "data", "train", "sample"}}


def room_of(name):
    return name.split(".")[0].removesuffix(".py")


def test_imports_flow_one_way_between_the_rooms():
    """model.py imports nothing of the project; parallel/ model.py; data/ those two; config.py those three;
    train.py and sample.py those; bench/ anything, and nothing imports bench/."""
    wrong = []
    for path in PYTHON:
        room = room_of(path.relative_to(REPO).parts[0])
        if room == "tests":
            continue
        assert room in ROOMS, f"{path.relative_to(REPO)} is in no room of the house"
        used = {room_of(m) for m in imported_modules(path) if m} & set(ROOMS) - {room}
        wrong += [f"{path.relative_to(REPO)} imports {r}" for r in sorted(used - ROOMS[room])]
    assert not wrong, wrong


SYMBOLS = set("NLdfTbMegPVEKRtc")  # the README's symbols (N parameters, M micro-batches, ...)


def test_no_module_alias_shadows_a_symbol_of_the_notes():
    shadowing = [f"{p.relative_to(REPO)}: import {a.name} as {a.asname}" for p in PYTHON
                 for node in ast.walk(ast.parse(p.read_text())) if isinstance(node, (ast.Import, ast.ImportFrom))
                 for a in node.names if a.asname in SYMBOLS]
    assert not shadowing, shadowing


CORE = [p for p in PYTHON if p.parent == REPO or p.relative_to(REPO).parts[0] in ("parallel", "data", "saves")]


def sentence_lengths(paths):
    """Words per sentence of every module, class and function docstring in the files."""
    lengths = []
    for path in paths:
        tree = ast.parse(path.read_text())
        nodes = [tree] + [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))]
        for doc in filter(None, map(ast.get_docstring, nodes)):
            text = re.sub(r"\s+", " ", doc)
            lengths += [len(s.split()) for s in re.split(r"(?<=[.!?])\s+", text) if s.strip()]
    return lengths


def prose_figures():
    """(mean words per docstring sentence in parallel/, share of the core's lines over 100 columns)."""
    lengths = sentence_lengths([p for p in PYTHON if p.relative_to(REPO).parts[0] == "parallel"])
    lines = [line for p in CORE for line in p.read_text().splitlines()]
    return sum(lengths) / len(lengths), sum(len(line) > 100 for line in lines) / len(lines)


def test_one_plain_voice():
    """Short sentences in the field's words, lines within 100 columns (python tests/test_structure.py
    prints both figures)."""
    words, wide = prose_figures()
    assert words <= 15, f"parallel/ docstring sentences average {words:.1f} words"
    assert wide <= 0.05, f"{wide:.1%} of the core's lines pass 100 columns"


if __name__ == "__main__":
    words, wide = prose_figures()
    print(f"parallel/ docstring sentences: {words:.1f} words on average; core lines over 100 columns: {wide:.1%}")
