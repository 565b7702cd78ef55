"""The bench commands the READMEs and the Makefile show are commands that run: every module they name answers
--help as `python -m` runs it, the drawings bench/README.md prints are what their commands print today, no line shows
a script's old file path, and `make bench` / `make bench-quick` call run_all."""
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
READMES = [REPO / "README.md", REPO / "bench" / "README.md"]
COMMAND = re.compile(r"python -m (bench(?:\.[a-z_]+)+)(?![.\w])|python (compare\.py)\b")  # not bench.labs.NAME
HELP = """import runpy, sys
for target in sys.argv[1:]:
    sys.argv = [target, "--help"]
    try:
        runpy.run_path(target, run_name="__main__") if target.endswith(".py") else runpy.run_module(
            target, run_name="__main__", alter_sys=True)
        print(f"EXIT {target} none", flush=True)
    except SystemExit as e:
        print(f"EXIT {target} {e.code}", flush=True)
"""  # each target as `python -m TARGET --help` (or `python TARGET.py --help`) runs it, in one process


def documented():
    """{module or script: the README line that first shows it}."""
    found = {}
    for readme in READMES:
        for line in readme.read_text().splitlines():
            for m in COMMAND.finditer(line):
                found.setdefault(m[1] or m[2], f"{readme.name}: {line.strip()}")
    return found


def test_the_readmes_show_the_main_commands():
    assert {"bench.gpu", "bench.planner", "bench.cluster", "bench.vs_torch", "bench.run_all", "bench.compare",
            "bench.labs.pp_draw", "bench.labs.placement"} <= set(documented())


def test_every_documented_command_answers_help():
    targets = sorted(documented())
    done = subprocess.run([sys.executable, "-c", HELP, *targets], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    parts = re.split(r"^EXIT (\S+) (\S+)$", done.stdout, flags=re.M)  # [usage, target, code, usage, ...]
    got = {target: (code, usage) for usage, target, code in zip(parts[0::3], parts[1::3], parts[2::3])}
    assert list(got) == targets, done.stderr[-3000:]
    for target, (code, usage) in got.items():
        assert code == "0" and "usage:" in usage, f"{documented()[target]}\n-> exit {code}: {usage[-500:]}"


def test_no_readme_shows_a_scripts_old_file_path():
    """The scripts run as modules now: `python bench/NAME.py` would find none of its imports."""
    for readme in READMES:
        old = [line for line in readme.read_text().splitlines() if re.search(r"python3? bench/\w+\.py", line)]
        assert not old, f"{readme.name}: {old}"


@pytest.mark.parametrize("module", ["bench.labs.pp_draw", "bench.labs.placement"])
def test_the_drawings_in_bench_readme_are_what_their_commands_print(module):
    text = (REPO / "bench" / "README.md").read_text()
    m = re.search(rf"`(python -m {re.escape(module)} [^`]*)`[^\n]*\n(?:[^\n]+\n)*?\n```\n(.*?)\n```", text, re.S)
    assert m, f"bench/README.md shows no drawing under `python -m {module} ...`"
    done = subprocess.run([sys.executable, *shlex.split(m[1])[1:]], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    printed, shown = done.stdout.rstrip("\n").splitlines(), m[2].splitlines()
    assert done.returncode == 0 and printed[1:] == shown[1:], done.stdout + done.stderr
    assert printed[0].startswith(shown[0].split(",")[0])  # the README shortens the legend line to fit its width


def test_make_bench_and_bench_quick_call_run_all():
    recipes = re.findall(r"^(bench(?:-quick)?):.*\n\t(.*)$", (REPO / "Makefile").read_text(), re.M)
    assert dict(recipes) == {"bench": "$(PY) -m bench.run_all", "bench-quick": "$(PY) -m bench.run_all --quick"}


def test_a_result_file_is_headed_by_the_command_that_makes_it(tmp_path):
    """Each lab answer keeps its command: the module form a person reruns, without the --out it was written to."""
    done = subprocess.run([sys.executable, "-m", "bench.labs.mfu_sweep", "--flops-only", "--out", str(tmp_path)],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = (tmp_path / "L21_flops_per_step.md").read_text().splitlines()
    assert lines[2] == "Command: `python -m bench.labs.mfu_sweep --flops-only`  "
