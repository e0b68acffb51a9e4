"""The README and docs/ cannot rot: their links resolve and their command lines parse.

Links: every relative link and image in ``README.md`` and ``docs/*.md``
(outside code) names a file or folder that exists; anchors are not checked.

Commands: every ``lit-grpo ...`` command in a fenced ``bash``/``sh``/untagged
block parses against the current CLI. How a block becomes commands:

1. lines ending in ``\\`` join the next; ``#`` starts a comment;
2. ``&&``, ``||``, ``;`` and ``|`` separate commands, and leading ``VAR=value``
   assignments are dropped; a command is one whose first word is ``lit-grpo``;
3. a command holding a placeholder, a word of capitals (``CONFIG``,
   ``RUN_DIR``, ``N``) or ``…``/``...``, is a usage synopsis, not a command
   line, and is not run;
4. ``lit-grpo plot RUN_DIR ...`` runs for real, on a small ``metrics.csv``
   written where RUN_DIR points (plot has no ``--print_config``); every other
   command runs in-process with ``--print_config`` appended, which builds the
   whole parser and validates every value without loading a model or data (a
   ``--help`` in the line prints the help instead; both exit 0).
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from lit_grpo.cli import COMMANDS, main

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

FENCE = re.compile(r"^```([\w+-]*)[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)
SHELL = {"", "bash", "sh", "shell", "console"}
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
SEPARATORS = {"&&", "||", ";", "|"}
ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
PLACEHOLDER = re.compile(r"^[A-Z][A-Z0-9_]*$|…|\.\.\.")


def relative_links(page: Path) -> list[str]:
    """The link targets of a page's Markdown outside code blocks and code spans, less URLs and anchors."""
    prose = INLINE_CODE.sub("", FENCE.sub("", page.read_text(encoding="utf-8")))
    targets = [match.group(1) for match in LINK.finditer(prose)]
    return [t for t in targets if not re.match(r"^([a-z][a-z0-9+.-]*:|#)", t)]


def commands(text: str) -> list[list[str]]:
    """The ``lit-grpo`` command lines of the shell blocks in ``text``, as words (rules 1-2 above)."""
    found = []
    for language, body in FENCE.findall(text):
        if language not in SHELL:
            continue
        for line in body.replace("\\\n", " ").splitlines():
            lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
            lexer.whitespace_split, lexer.commenters = True, "#"
            command = []
            for word in [*lexer, ";"]:
                if word in SEPARATORS:
                    if command[:1] == ["lit-grpo"]:
                        found.append(command[1:])
                    command = []
                elif command or not ASSIGNMENT.match(word):
                    command.append(word)
    return found


def documented_commands() -> list[tuple[str, list[str]]]:
    return [(page.relative_to(ROOT).as_posix(), words) for page in PAGES for words in commands(page.read_text())]


def is_synopsis(words: list[str]) -> bool:
    return any(PLACEHOLDER.search(part) for word in words for part in word.split("="))


def test_the_rules_find_commands_as_written():
    block = (
        "```bash\npip install -e . \\\n  && lit-grpo fit --config a.yaml   # note\n"
        'LIT_GRPO_DEBUG=1 lit-grpo eval --pass_k "[1,4]"; echo done\n'
        "lit-grpo plot RUN_DIR\n```\n```yaml\nlit-grpo: not a command\n```\n"
    )
    found = commands(block)
    assert found == [["fit", "--config", "a.yaml"], ["eval", "--pass_k", "[1,4]"], ["plot", "RUN_DIR"]]
    assert [is_synopsis(words) for words in found] == [False, False, True]


def test_the_docs_show_commands():
    # Guards the rules above: a regex that found nothing would pass every check below.
    shown = documented_commands()
    assert len(shown) >= 30 and {words[0] for _, words in shown} >= {"fit", "eval", "plot", "ppo", "dpo"}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_links_resolve(page):
    missing = []
    for target in relative_links(page):
        path = (page.parent / target.split("#")[0]).resolve()
        if path.exists():
            continue
        missing.append(target)
    assert not missing, f"{page.name} links to files that do not exist: {missing}"


@pytest.mark.parametrize(
    ("page", "words"),
    documented_commands(),
    ids=[f"{page}:{' '.join(words)[:70]}" for page, words in documented_commands()],
)
def test_command_parses(page, words, tmp_path, monkeypatch, capsys):
    if is_synopsis(words):
        pytest.skip("a usage synopsis (rule 3)")
    if words[0] not in COMMANDS and not words[0].startswith("-"):
        pytest.fail(f"{page}: 'lit-grpo {' '.join(words)}': the CLI has no command {words[0]!r}")
    if words[0] == "plot":
        monkeypatch.chdir(tmp_path)
        run_dir = tmp_path / next(word for word in words[1:] if not word.startswith("-"))
        run_dir.mkdir(parents=True)
        (run_dir / "metrics.csv").write_text("epoch,step,train/kl,val/accuracy\n-1,0,,0.1\n0,1,0.01,\n1,2,0.02,0.3\n")
        main(words)
        assert (run_dir / "curves.png").is_file()
        return
    monkeypatch.chdir(ROOT)
    helps = bool({"-h", "--help"} & set(words))
    try:
        main(words if helps else [*words, "--print_config"])
        code = 0 if helps else "returned: the parse did not stop, so the command ran"  # plain --help returns
    except SystemExit as exit_info:
        code = exit_info.code or 0
    assert code == 0, f"{page}: 'lit-grpo {' '.join(words)}': {code}\n{capsys.readouterr().err[-2000:]}"


def test_print_config_loads_no_model():
    # In a fresh interpreter, so what other tests imported does not count.
    code = (
        "import sys\nfrom lit_grpo.cli import main\ntry:\n"
        "    main(['fit', '--config', 'configs/quickstart.yaml', '--print_config'])\nexcept SystemExit:\n    pass\n"
        "print([m for m in sys.modules if m == 'peft' or m.startswith('transformers.models.llama.modeling')])"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "name_or_path: embedded" in done.stdout, done.stderr[-2000:]  # it printed
    assert done.stdout.strip().splitlines()[-1] == "[]"  # loading the model imports both


def test_the_readme_shows_the_command_ci_runs():
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line.startswith("python3 -m pip")]
    readme_blocks = [body for _, body in FENCE.findall((ROOT / "README.md").read_text())]
    assert len(ci) == 1 and any(ci[0] in body.splitlines() for body in readme_blocks), ci


def test_the_readme_stays_a_front_page():
    # The depth lives in docs/ (issue 30): a README past this length buries what lit_grpo is.
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250
