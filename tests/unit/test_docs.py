"""The README and docs/ hold together: every relative link resolves, the README starts with the two commands CI and
a newcomer run, stays a page for users, and no file of the repository is over 1 MB (raw bench output stays out)."""

import pathlib
import re
import subprocess

ROOT = pathlib.Path(__file__).parents[2]


def markdown_files():
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def test_every_relative_link_in_the_readme_and_docs_resolves():
    broken = []
    for path in markdown_files():
        text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            if not (path.parent / target.split("#")[0]).exists():
                broken.append(f"{path.relative_to(ROOT)}: {target}")
    assert not broken, broken


def test_the_readme_starts_with_the_demo_and_the_test_command_ci_runs():
    readme = (ROOT / "README.md").read_text()
    block = readme.split("```sh\n", 1)[1].split("```", 1)[0]
    assert [line.split("#")[0].strip() for line in block.splitlines()] == ["make demo", "make test"]
    assert "make test" in (ROOT / ".ci/run").read_text()
    assert len(readme.encode()) <= 15_000, "the README is for users; lab notes go to docs/"


def test_no_tracked_file_is_over_a_megabyte():
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    large = [name for name in files if (ROOT / name).is_file() and (ROOT / name).stat().st_size > 1_000_000]
    assert not large, large


def test_every_dated_report_names_its_date_machine_and_command():
    reports = sorted((ROOT / "docs/results").glob("20??-??-??-*.md"))
    assert reports
    index = (ROOT / "docs/results/README.md").read_text()
    for report in reports:
        head = report.read_text().split("\n\n", 2)[1]
        assert f"- Date: {report.name[:10]}" in head and "- Machine: " in head and "- Command: " in head, report.name
        assert f"]({report.name})" in index, f"{report.name} is not in docs/results/README.md"
