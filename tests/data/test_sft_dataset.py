"""SFT data: which tokens count in the loss for each format, padding without leaks, bad lines named."""

import json

import pytest

from data.sft_dataset import SFTDataError, SFTDataset, build_sft_datasets, encode_example, read_sft_file
from data.tokenizers.null import NullTokenizer


class _Chars:
    """A tokenizer of one id per character (ord), eod 0, and optionally a chat template."""

    eod, pad, vocab_size = 0, -1, 256

    def __init__(self, template=None):
        self.chat_template = template
        self.special_tokens = {"eos_token": "<e>"}

    def encode(self, text):
        return [ord(c) for c in text]


def _text(ids, learn, counted=True):
    return "".join("|" if i == 0 else chr(i) for i, keep in zip(ids, learn) if keep == counted)


def test_only_the_answers_count():
    ids, learn = encode_example([("prompt", "2+2="), ("response", "4")], _Chars())
    assert _text(ids, learn) == "4|" and _text(ids, learn, False) == "2+2="
    turns = [("system", "be brief"), ("user", "hi"), ("assistant", "hello"), ("user", "bye"),
             ("assistant", "ciao")]
    ids, learn = encode_example(turns, _Chars())
    assert _text(ids, learn) == "hello|ciao|"  # the default format: "<role>: <content>\n", answers end in eod
    assert _text(ids, learn, False) == "system: be brief\nuser: hi\nassistant: \nuser: bye\nassistant: \n"
    template = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% if m.role == 'assistant' %}{{ "
                "eos_token }}"
                "{% endif %}{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")
    ids, learn = encode_example(turns, _Chars(template))  # the tokenizer's own template
    assert _text(ids, learn) == "hello<e>ciao<e>"
    assert _text(ids, learn, False) == "<system>be brief<user>hi<assistant><user>bye<assistant>"


def test_examples_are_padded_not_packed_and_labels_shift():
    examples = [encode_example([("prompt", "ab"), ("response", "c")], _Chars())]
    sample = SFTDataset(examples, seq_length=6, num_samples=1, seed=0, pad_id=0)[0]
    assert (sample["tokens"].tolist() == [97, 98, 99, 0, 0, 0]
            and sample["labels"].tolist() == [98, 99, 0, 0, 0, 0])
    assert sample["loss_mask"].tolist() == [0, 1, 1, 0, 0, 0]  # predict c and the eod, nothing of the padding
    assert sample["position_ids"].tolist() == list(range(6))  # every example starts at position 0


def test_bad_lines_are_named_with_their_number(tmp_path):
    path = tmp_path / "sft.jsonl"
    path.write_text(json.dumps({"prompt": "a", "response": "b"}) + "\n"
                    + json.dumps({"messages": [{"role": "user", "content": "no answer"}]}) + "\n")
    with pytest.raises(SFTDataError, match=f"--data-path {path}, line 2: no assistant turn"):
        read_sft_file(str(path))
    path.write_text('{"text": "plain"}\n')
    with pytest.raises(SFTDataError, match="line 1: expected"):
        read_sft_file(str(path))
    path.write_text(json.dumps({"prompt": "1 2", "response": "3"}) + "\n")  # the NullTokenizer reads ids
    with pytest.raises(SFTDataError, match="the valid split of 1 SFT examples is empty"):
        build_sft_datasets([str(path)], "1,0,0", 8, 0, (4, 4, 0), NullTokenizer(10))


REAL_TEMPLATE = (  # the constructs real templates use: raise_exception, namespace, break, tojson, trim
    "{% if messages[0]['role'] != 'system' %}{{ raise_exception('Conversations must start with a system "
    "prompt') }}{% endif %}{% set ns = namespace(turns=0) %}"
    "{% for m in messages %}{% if ns.turns >= 4 %}{% break %}{% endif %}{% set ns.turns = ns.turns + 1 %}"
    "<|{{ m['role'] }}|>{% if m['role'] == 'system' %}{{ {'text': m['content']} | tojson }}"
    "{% else %}{{ m['content'] | trim }}{% endif %}"
    "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")


def test_chat_templates_render_in_a_sandbox_as_transformers_renders_them():
    """A template with break, namespace, tojson and raise_exception renders as transformers' own
    apply_chat_template renders it; one that reaches Python's internals or mutates its input is refused
    with one line naming its file, as is one that raises."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models

    from data.sft_dataset import template_renderer

    vocabulary = Tokenizer(models.WordLevel({"<e>": 0, "[UNK]": 1}, unk_token="[UNK]"))
    theirs = transformers.PreTrainedTokenizerFast(tokenizer_object=vocabulary, eos_token="<e>")
    theirs.chat_template = REAL_TEMPLATE
    render = template_renderer(REAL_TEMPLATE, "model/tokenizer_config.json")
    messages = [{"role": "system", "content": "be brief \u00e9"}, {"role": "user", "content": "  hi  "},
                {"role": "assistant", "content": "hello"}, {"role": "user", "content": "bye"},
                {"role": "assistant", "content": "not rendered: the loop breaks after 4 turns"}]
    for count in range(1, len(messages) + 1):
        for prompt in (False, True):
            assert render(messages=messages[:count], add_generation_prompt=prompt, eos_token="<e>") == \
                theirs.apply_chat_template(messages[:count], tokenize=False, add_generation_prompt=prompt)
    with pytest.raises(SFTDataError, match=r"^model/tokenizer_config.json: its chat_template raised: "
                                           "Conversations must start with a system prompt$"):
        render(messages=messages[1:], add_generation_prompt=False, eos_token="<e>")
    for hostile in ("{{ ''.__class__.__mro__[1].__subclasses__() }}",
                    "{{ messages.__class__.__init__.__globals__ }}",
                    "{% set _ = messages.append({'role': 'user'}) %}{{ messages | length }}",
                    "{{ cycler.__init__.__globals__.os.system('echo pwned') }}"):
        with pytest.raises(SFTDataError, match=r"^model/x.jinja: its chat_template was refused: it reaches "
                                               r"past the sandbox \(.*\); a template from a downloaded"):
            template_renderer(hostile, "model/x.jinja")(messages=messages, add_generation_prompt=False)
    turns = [("user", "hi"), ("assistant", "hello")]
    with pytest.raises(SFTDataError, match="its chat_template raised"):  # through encode_example too
        encode_example(turns, _Chars(REAL_TEMPLATE))
