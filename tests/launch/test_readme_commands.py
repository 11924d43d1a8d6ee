"""launch.tools.readme_commands finds every command README.md gives and has a way to run each (a scaling
rule) or a reason not to (a cluster, root): a command a later README adds cannot be silently missed.
Reads the README only; nothing is run (a run that selects no command says its temporary folder is
gone)."""

import os
import re

import pytest

from launch.tools import readme_commands as rc

REPOSITORY = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRAINING = re.compile(r"^(python -m launch\.torchrun|bash launch/(main|finetune)_job\.sh)\b")


@pytest.fixture(scope="module")
def readme():
    with open(os.path.join(REPOSITORY, "README.md")) as handle:
        return handle.read()


def _bash_lines(readme):
    """Every line of the README's ```bash blocks that is no comment line."""
    blocks = re.findall(r"^```bash\n(.*?)^```", readme, re.S | re.M)
    return [line for block in blocks for line in block.splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


def test_every_command_of_the_readme_is_found(readme):
    found = rc.commands(readme)
    lines = _bash_lines(readme)
    continued = sum(line.rstrip().endswith("\\") for line in lines)
    assert len(found) == len(lines) - continued  # one command per line not continued from the one before
    texts = [command.text for command in found]
    counted = sum(strip.count("python -m ") for strip in map(rc.strip_comment, lines))
    assert sum(text.count("python -m ") for text in texts) == counted > 10
    assert texts[:2] == ["bash launch/main_job.sh",  # the two set-up commands first
                         ". .venv/bin/activate && OMP_NUM_THREADS=1 python -m pytest -q"]
    example = [text for text in texts if text.startswith("python -c ")]
    assert len(example) == 1 and "pretrain.load_model(" in example[0] and ".shape)\"" in example[0]
    for command in found:
        assert "\\\n" not in command.text and not command.text.endswith("\\"), command
        assert rc.strip_comment(command.text) == command.text, command  # no comment left
        assert readme.splitlines()[command.line - 1].strip().startswith(command.text.split()[0]), command


def test_every_command_has_a_scaling_rule_or_a_reason_to_skip_it(readme):
    skipped = []
    for command in rc.commands(readme):
        rule = rc.rule_of(command)
        assert rule is not None, f"README.md:{command.line}: {command.text}: add a rule to RULES"
        assert rule.note, rule
        if rule.skip:
            skipped.append(command.text)
            continue
        line = rc.scaled(command, rule)  # asserts that every placeholder of the rule is in the command
        words = command.text
        for placeholder, value in rule.replace:
            words = words.replace(placeholder, value)
        assert line == " ".join([words, *rule.append])  # the README's words, only flags appended
        assert set(rule.needs) <= set(rc.PREPARE) | {"sweep"}, rule.needs
        if TRAINING.match(command.text):
            assert re.search(r" --train-iters 3\b(?!.*--train-iters)", line), line  # appended: it wins
        if "pytest" in command.text:
            assert line.endswith("-k test_layout")
    assert any(text.startswith("sbatch ") for text in skipped)
    assert any("MASTER_ADDR=" in text for text in skipped)
    note = rc.rule_of(rc.Command("NNODES=4 MASTER_ADDR=node001 bash launch/multinode.sh", 1)).note
    path = re.search(r"tests/launch/\w+\.py", note)[0]
    assert os.path.exists(os.path.join(REPOSITORY, path)), note


def test_an_unknown_command_has_no_rule():
    assert rc.rule_of(rc.Command("python -m launch.something_new --flag", 1)) is None


def test_commands_join_continuations_and_drop_comments():
    readme = "\n".join([
        "text", "```bash", "# a comment line", "python -m a --x 1 \\", "    --y 2   # says y", "",
        "sudo thing", "```", "```python", "python -m not_bash", "```",
        "```bash", "python -c \"import a; \\", "           print('#', a)\"   # trailing", "```"])
    found = rc.commands(readme)
    assert [(command.text, command.line) for command in found] == [
        ("python -m a --x 1     --y 2", 4), ("sudo thing", 7),
        ("python -c \"import a;            print('#', a)\"", 13)]
    assert rc.rule_of(found[1]).skip


@pytest.mark.parametrize("line, kept", [
    ("a b # c", "a b"), ("a 'b # c' # d", "a 'b # c'"), ('a "b # c"', 'a "b # c"'), ("a#b", "a#b"),
    ("a \\# b", "a \\# b"), ("# all", ""),
])
def test_strip_comment_reads_a_comment_as_bash_does(line, kept):
    assert rc.strip_comment(line) == kept


def test_scaled_appends_flags_and_replaces_placeholders_only():
    rule = rc.Rule("x", "note", append=("--train-iters", "3"), replace=(("/local/nvme", "local-nvme"),))
    assert rc.scaled(rc.Command("run --nvme-path /local/nvme --k v", 1), rule) == \
        "run --nvme-path local-nvme --k v --train-iters 3"


def test_a_temporary_work_folder_is_said_removed_not_named_as_the_outputs(capsys):
    with pytest.raises(SystemExit) as exit_status:
        rc.main(["--only", "no README command holds this text"])
    assert exit_status.value.code == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    folder = re.search(r"(\S+readme-commands-\S+) removed \(--keep DIR keeps the outputs\)$", last)
    assert folder and not os.path.exists(folder.group(1)) and "outputs in" not in last
