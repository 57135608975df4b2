"""`scripts/regenerate_doc_figures.py` and the docs agree, without running its (minutes-long) commands: every marked
figure names a figure set and field the script produces, every set is quoted, and each recipe set runs exactly the
command recipes/README.md shows for its row."""

import re
import shlex
from pathlib import Path

import pytest
from script_loading import load_script

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def figures():
    return load_script("scripts/regenerate_doc_figures.py", "longattn_regenerate_doc_figures")


def test_markers_and_figure_sets_agree(figures):
    assert figures.check_markers() == []
    quoted = {(s, f) for path in figures.doc_files() for s, f, _ in figures.find_markers(path.read_text())}
    assert ("quickstart", "validation_accuracy") in quoted and ("quickstart", "test_accuracy") in quoted


def test_malformed_or_unknown_markers_are_reported(figures, tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text(
        "<!-- figure:quickstart.nope -->1<!-- /figure --> <!-- figure:elsewhere.x -->2<!-- /figure -->"
    )
    (tmp_path / "docs" / "a.md").write_text("<!-- figure:quickstart.steps -->400")
    problems = "\n".join(figures.check_markers(tmp_path))
    assert "has no field 'nope'" in problems and "figure set 'elsewhere' is unknown" in problems
    assert "docs/a.md: 1 `<!-- figure:NAME -->` and 0" in problems


def test_rewrite_replaces_only_the_sets_it_is_given(figures):
    text = (
        "accuracy <!-- figure:quickstart.test_accuracy -->1.000<!-- /figure --> and "
        "<!-- figure:listops_mlm.accuracy -->0.688<!-- /figure -->"
    )
    new = figures.rewrite(text, {"quickstart": {"test_accuracy": "0.892"}})
    assert new == text.replace("1.000", "0.892")
    assert figures.rewrite(new, {"quickstart": {"test_accuracy": "0.892"}}) == new  # a rerun is stable


def _readme_commands() -> list[list[str]]:
    """The `python ...` commands of recipes/README.md's demo block, `$M` expanded, split as the shell would."""
    text = (REPO / "recipes" / "README.md").read_text()
    block = re.search(r"```bash\n(M=.*?)```", text, re.S)[1].replace("\\\n", " ")
    model = re.search(r'^M="(.*)"$', block, re.M)[1]
    return [shlex.split(line.replace("$M", model)) for line in block.splitlines() if line.startswith("python ")]


def _flags(argv: list[str]) -> tuple[str, dict[str, str]]:
    """`python SCRIPT --flag value ...` -> (SCRIPT, flags but --output_dir, which the figures script replaces)."""
    flags = dict(zip(argv[2::2], argv[3::2]))
    flags.pop("--output_dir")
    return argv[1], flags


def test_recipe_sets_run_the_commands_the_readme_shows(figures):
    shown = _readme_commands()
    recipes = [_flags(argv) for argv in shown if argv[1].startswith("recipes/")]
    assert len(recipes) == 4
    for name, spec in figures.FIGURE_SETS.items():
        if spec.data is None:
            continue  # the quickstart runs scripts/quickstart.sh itself
        assert _flags(spec.command) in recipes, name
        task, *knobs = figures.DATA[spec.data]
        data_command = [
            "python",
            "-m",
            "longattn.train.data",
            task,
            "--output_dir",
            f"data/generated/{spec.data}",
            *knobs,
        ]
        assert data_command in shown, name
