"""CI runs what the README says: the two commands of README.md's "## 兩個指令" are what `.ci/run` runs (it reads
them out of the README at run time), and the Makefile's and the GPU workflow's test commands are the README's.

The oracle is the README's text itself; `.ci/run --print-commands` is the script's own extraction, the one its
run step executes."""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
CI = REPO / ".ci" / "run"

if shutil.which("bash") is None:  # pragma: no cover
    pytest.skip("needs bash to run .ci/run", allow_module_level=True)


def readme_commands(readme: Path = REPO / "README.md") -> list[str]:
    """The one-line bodies of the fenced ```bash blocks in the README's section "## 兩個指令", in order."""
    lines = readme.read_text(encoding="utf-8").splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("## 兩個指令"))
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    commands, inside = [], None
    for line in lines[start + 1:end]:
        if inside is None and line.strip() == "```bash":
            inside = []
        elif inside is not None and line.strip() == "```":
            commands.append("\n".join(inside).strip())
            inside = None
        elif inside is not None:
            inside.append(line)
    return commands


def ci_commands(ci: Path = CI) -> list[str]:
    p = subprocess.run(["bash", str(ci), "--print-commands"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    return p.stdout.splitlines()


def test_readme_has_the_two_commands_newcomers_type():
    """Breaks if the section loses a block, or a block stops being the install + run / install + test pair."""
    run, test = readme_commands()
    assert run.startswith("pip install -e . && ") and "python -m labutils run " in run
    assert test.startswith('pip install -e ".[test]" && ') and "python -m pytest" in test and "*.ipynb" in test


def test_ci_runs_exactly_the_readme_commands():
    """Breaks if .ci/run's extraction drifts from the README (another section, a third block, a changed line)."""
    assert ci_commands() == readme_commands()[:2]


def test_ci_reads_the_commands_from_the_readme_at_run_time(tmp_path):
    """Breaks if .ci/run hard-codes its commands: with another README beside it, it must run the new ones. And
    its run step executes exactly the extracted commands, each as written, in a fresh venv."""
    (tmp_path / ".ci").mkdir()
    shutil.copy(CI, tmp_path / ".ci" / "run")
    text = (REPO / "README.md").read_text(encoding="utf-8")
    run, test = readme_commands()
    (tmp_path / "README.md").write_text(text.replace(run, "echo first").replace(test, "echo second"), encoding="utf-8")
    assert ci_commands(tmp_path / ".ci" / "run") == ["echo first", "echo second"]
    (tmp_path / "README.md").write_text(text.replace("```bash\n" + test, "```text\n" + test), encoding="utf-8")
    p = subprocess.run(["bash", str(tmp_path / ".ci" / "run"), "--print-commands"], capture_output=True, text=True)
    assert p.returncode != 0 and "兩個指令" in p.stderr  # one block lost: refused, not half run
    script = CI.read_text(encoding="utf-8")
    assert re.search(r'python -m venv "\$WORK/venv"', script) and 'source "$WORK/venv/bin/activate"' in script
    loop = re.search(r'for i in "\$\{!COMMANDS\[@\]\}"; do\n(.*?)\ndone\n', script, re.S)
    assert loop, "one loop over the README's commands"
    assert re.search(r'cmd="\$\{COMMANDS\[\$i\]\}"\s+echo "\\\$ \$cmd"\s+bash -euo pipefail -c "\$cmd"\s*$', loop.group(1))
    # the first install may skip pip's one-core bytecode compile (compileall does it on every core), the test command
    # installs as written: breaks if PIP_NO_COMPILE reached the tests' processes (each would compile what it imports)
    tests_branch = re.search(r'if \[\[ \$i -eq 1 \]\]; then(.*?)\n    fi\n', loop.group(1), re.S)
    assert tests_branch and "unset PIP_NO_COMPILE" in tests_branch.group(1) and "compileall" in tests_branch.group(1)
    assert "--nbval" not in script and "pytest tests" not in script.split("STEP1_PID=$!")[1], \
        "the README's test command belongs in the README only"


def test_makefile_and_gpu_workflow_run_the_readme_test_command():
    """Breaks if `make test` or the GPU workflow's test step runs another pytest line than the README's."""
    test = readme_commands()[1]
    pytest_part = test.split(" && ", 1)[1]
    recipe = re.search(r"^test:\n\t(.+)$", (REPO / "Makefile").read_text(), re.M).group(1)
    assert recipe.replace("$(PYTHON)", "python") == pytest_part
    workflow = (REPO / ".github" / "workflows" / "gpu-smoke.yml").read_text(encoding="utf-8")
    assert 'bash -euo pipefail -c "$(.ci/run --print-commands | sed -n 2p)"' in workflow
