"""Text <-> token ids for one model directory.

This module owns the `Tokenizer` (a Hugging Face `tokenizers` tokenizer plus the
end-of-sequence ids, the BOS id and the chat template read from the model
directory) and the `IncrementalDetokenizer` that turns a stream of output ids into
text deltas without ever cutting a UTF-8 character in half.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.meta
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

REPLACEMENT_CHAR = "\ufffd"


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}


def _token_content(value: Any) -> str | None:
    # tokenizer_config.json writes special tokens either as "text" or as an
    # AddedToken dict {"content": "text", ...}.
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _special(value: Any) -> Any:
    """An AddedToken dict as its text; any other value as it is."""
    content = _token_content(value) if isinstance(value, Mapping) else None
    return value if content is None else content


def _ids(value: Any) -> list[int]:
    # config.json / generation_config.json hold eos_token_id as an int or a list.
    if isinstance(value, bool) or value is None:
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class Tokenizer:
    """A model's tokenizer: encode, decode, chat template and stop ids.

    Build it with `Tokenizer.from_dir(model_dir)`; the constructor takes already
    parsed parts so tests can assemble one directly.
    """

    def __init__(
        self,
        backend: HFTokenizer,
        *,
        eos_token_ids: Iterable[int],
        bos_token_id: int | None,
        chat_template: str | None,
        template_vars: Mapping[str, str] | None = None,
        config: Mapping[str, Any] | None = None,
    ) -> None:
        self._backend = backend
        self._config = dict(config or {})  # tokenizer_config.json
        self._eos = frozenset(eos_token_ids)
        self._bos = bos_token_id
        self._chat_template_src = chat_template
        # Special-token strings (bos_token, eos_token, …) that templates may refer to.
        self._template_vars = dict(template_vars or {})
        self._compiled: jinja2.Template | None = None

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load tokenizer.json, tokenizer_config.json, generation_config.json and
        config.json from a Hugging Face model directory."""
        root = Path(path)
        tok_file = root / "tokenizer.json"
        if not tok_file.is_file():
            raise FileNotFoundError(f"no tokenizer.json in model directory {root}")
        backend = HFTokenizer.from_file(str(tok_file))
        tok_cfg = _read_json(root / "tokenizer_config.json")
        gen_cfg = _read_json(root / "generation_config.json")
        model_cfg = _read_json(root / "config.json")

        template_vars: dict[str, str] = {}
        for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
            content = _token_content(tok_cfg.get(key))
            if content is not None:
                template_vars[key] = content

        # Every source of an end id counts: chat models often stop on the turn end
        # (tokenizer eos) and on the document end (generation_config eos list).
        eos: set[int] = set()
        eos_text = template_vars.get("eos_token")
        eos_id = backend.token_to_id(eos_text) if eos_text is not None else None
        if eos_id is not None:
            eos.add(eos_id)
        eos.update(_ids(gen_cfg.get("eos_token_id")))
        eos.update(_ids(model_cfg.get("eos_token_id")))

        bos: int | None = None
        bos_text = template_vars.get("bos_token")
        if bos_text is not None:
            bos = backend.token_to_id(bos_text)
        if bos is None:
            found = _ids(gen_cfg.get("bos_token_id")) or _ids(model_cfg.get("bos_token_id"))
            bos = found[0] if found else None

        return cls(
            backend,
            eos_token_ids=eos,
            bos_token_id=bos,
            chat_template=_chat_template(root, tok_cfg),
            template_vars=template_vars,
            config=tok_cfg,
        )

    # ----- properties -------------------------------------------------------------

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Ids that end generation (union of tokenizer, generation and model configs)."""
        return self._eos

    @property
    def bos_token_id(self) -> int | None:
        """The beginning-of-sequence id, or None when the model has none."""
        return self._bos

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer knows, added tokens included."""
        return int(self._backend.get_vocab_size(with_added_tokens=True))

    @property
    def chat_template(self) -> str | None:
        """The Jinja chat template source, or None when the model has none."""
        return self._chat_template_src

    @property
    def backend(self) -> HFTokenizer:
        """The underlying `tokenizers.Tokenizer`."""
        return self._backend

    def info(self) -> dict[str, Any]:
        """The tokenizer's settings as transformers reads them (vLLM's
        ``/tokenizer_info``): tokenizer_config.json without its added-token table,
        special tokens as their text, the chat template in use and the class."""
        out: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast"}
        for key, value in self._config.items():
            if key == "added_tokens_decoder":
                continue
            if isinstance(value, list):
                out[key] = [_special(v) for v in value]
            else:
                out[key] = _special(value)
        out["chat_template"] = self._chat_template_src
        return out

    # ----- text <-> ids -----------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; `add_special_tokens` applies tokenizer.json's
        post-processor (e.g. a BOS prefix)."""
        return list(self._backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; incomplete UTF-8 sequences become U+FFFD."""
        return str(self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary string of one id (byte-level form), or None."""
        return self._backend.id_to_token(token_id)

    # ----- chat ------------------------------------------------------------------

    @functools.cached_property
    def renders_tools(self) -> bool:
        """Whether the chat template reads a ``tools`` variable (HF's convention for
        templates that render the tools themselves)."""
        if not self._chat_template_src:
            return False
        try:
            ast = ImmutableSandboxedEnvironment(
                extensions=["jinja2.ext.loopcontrols"]).parse(self._chat_template_src)
        except jinja2.TemplateError:
            return False
        return "tools" in jinja2.meta.find_undeclared_variables(ast)

    def render_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None, *, continue_final_message: bool = False,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """The chat template applied to `messages` (and `tools`, OpenAI tool objects, for a
        template that renders them), as text, as transformers' ``apply_chat_template``:
        ``continue_final_message`` ends the text inside the final message (what the
        model writes next continues it), ``template_kwargs`` are more variables for
        the template (over the special tokens').

        Raises ValueError when the model has no template, a message is malformed
        (not a dict, missing or non-string role, content neither a string nor, with
        ``tool_calls``, None), the template refuses the conversation (e.g. a role it
        does not know), or the final message to continue is empty or cut by the
        template.
        """
        _validate_messages(messages)
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message needs add_generation_prompt false")
        kwargs = dict(template_kwargs or {})
        taken = sorted({"messages", "tools", "add_generation_prompt"} & kwargs.keys())
        if taken:
            raise ValueError(f"template kwargs may not set {', '.join(taken)}")
        if tools is not None:
            kwargs["tools"] = tools
        try:
            text = self._template().render(
                **{**self._template_vars, **kwargs},
                messages=messages,
                add_generation_prompt=add_generation_prompt,
            )
        except jinja2.TemplateError as exc:
            raise ValueError(f"chat template rejected the messages: {exc}") from exc
        return _continued(text, messages[-1]) if continue_final_message else text

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None, *, continue_final_message: bool = False,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """Token ids of the rendered chat (``render_chat``). The template writes every
        special token itself, so the post-processor is not applied (as in transformers)."""
        return self.encode(self.render_chat(
            messages, add_generation_prompt, tools, continue_final_message=continue_final_message,
            template_kwargs=template_kwargs), add_special_tokens=False)

    def _template(self) -> jinja2.Template:
        if self._compiled is None:
            if not self._chat_template_src:
                raise ValueError("this model has no chat template (tokenizer_config.json)")
            # Same environment rules as transformers: sandboxed, trim/lstrip blocks,
            # loop controls, raise_exception() and strftime_now() available.
            env = ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
            )
            env.globals["raise_exception"] = _raise_exception
            env.globals["strftime_now"] = _strftime_now
            try:
                self._compiled = env.from_string(self._chat_template_src)
            except jinja2.TemplateError as exc:
                raise ValueError(f"chat template does not compile: {exc}") from exc
        return self._compiled


def _chat_template(root: Path, tok_cfg: Mapping[str, Any]) -> str | None:
    value = tok_cfg.get("chat_template")
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        # Named templates [{"name": ..., "template": ...}]: the chat one is "default".
        for entry in value:
            if isinstance(entry, Mapping) and entry.get("name") == "default":
                return str(entry.get("template"))
    # transformers >= 4.43 may save the template beside the config instead.
    jinja_file = root / "chat_template.jinja"
    return jinja_file.read_text(encoding="utf-8") if jinja_file.is_file() else None


def _continued(text: str, final: dict[str, Any]) -> str:
    """``text`` (a rendered chat) cut just after its ``final`` message's content, as
    transformers cuts it (templates that strip messages: after the stripped content)."""
    content = final.get("content")
    if not isinstance(content, str) or not content.strip():
        raise ValueError("continue_final_message needs a final message with text to continue")
    if content in text:
        return text[:text.rindex(content) + len(content)]
    at = text.rfind(content.strip())
    if at < 0:
        raise ValueError("continue_final_message: the chat template does not write the final "
                         "message as it is, so there is no place to continue it")
    kept = len(content.lstrip())
    return text[:at + (kept if text[at:at + kept] == content else len(content.strip()))]


def _validate_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts")
    for i, msg in enumerate(messages):
        if not isinstance(msg, Mapping):
            raise ValueError(f"messages[{i}] must be a dict, got {type(msg).__name__}")
        for key in ("role", "content"):
            if key not in msg:
                raise ValueError(f"messages[{i}] is missing {key!r}")
            if not isinstance(msg[key], str) and not (
                    key == "content" and msg[key] is None and msg.get("tool_calls")):
                raise ValueError(
                    f"messages[{i}][{key!r}] must be a string, got {type(msg[key]).__name__}"
                )
        if not msg["role"]:
            raise ValueError(f"messages[{i}]['role'] is empty")


class IncrementalDetokenizer:
    """Turns output ids, one at a time, into text deltas.

    Window over the ids (prefix/read offsets, as vLLM's detokenize_incrementally):

        ... already forgotten ... | prefix_offset ...... read_offset ...... end
                                  |<- decoded as context ->|<- new ids  ->|

    Each push decodes `ids[prefix_offset:]` and returns what lies beyond the text
    already emitted for the window. A trailing U+FFFD means the last bytes are an
    incomplete UTF-8 character (a later token may complete it), so that one
    character is held back; everything before it is final, because UTF-8 is
    self-synchronising. When the window's text ends cleanly the window slides to
    the last two token groups, so each push decodes a handful of tokens: O(1).

    Byte-level BPE also merges across character boundaries (CJK, emoji joiners),
    so a run of ids may never end cleanly. Past MAX_WINDOW ids the window restarts
    RESYNC_TAIL ids from the end: those hold the whole unfinished character (at
    most 3 bytes), and the orphan continuation bytes at the new start decode to a
    fixed junk prefix that is counted as already sent, never emitted.

    Contract: "".join(push(t) for t in ids) + finish() == tokenizer.decode(ids,
    skip_special_tokens), for byte-level BPE tokenizers.
    """

    # Prompt ids kept as context: enough for decoders that look at neighbours
    # (SentencePiece's leading-space rule); harmless for byte-level BPE.
    PROMPT_CONTEXT = 4
    MAX_WINDOW = 16
    RESYNC_TAIL = 4

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (),
                 skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        context = list(prompt_ids[-self.PROMPT_CONTEXT :])
        # A prompt that ends inside a character would leak into the output text;
        # start without context then.
        if self._decode(context).endswith(REPLACEMENT_CHAR):
            context = []
        self._ids: list[int] = context  # the window; index 0 is prefix_offset
        self._read = len(context)  # read_offset, relative to the window
        self._sent = len(self._decode(context))  # chars of decode(window) already emitted

    @property
    def window_size(self) -> int:
        """How many ids the next push decodes (stays small: the O(1) claim)."""
        return len(self._ids) + 1

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip) if ids else ""

    def push(self, token_id: int) -> str:
        """Add one output id; return the newly completed text (maybe empty)."""
        self._ids.append(int(token_id))
        text = self._decode(self._ids)
        if text.endswith(REPLACEMENT_CHAR):
            stable = len(text) - 1
            delta = text[self._sent : stable]
            self._sent = max(self._sent, stable)
            if len(self._ids) > self.MAX_WINDOW:
                self._resync(text)
            return delta
        delta = text[self._sent :]
        # Clean end: slide the window so it starts at the previous read offset,
        # which was itself a clean character boundary.
        del self._ids[: self._read]
        self._read = len(self._ids)
        self._sent = len(self._decode(self._ids))
        return delta

    def _resync(self, text: str) -> None:
        tail = self._ids[-self.RESYNC_TAIL :]
        tail_text = self._decode(tail)
        unsent = len(text) - self._sent  # the held character: 1
        # The tail must reproduce the window's ending once its junk prefix is
        # ignored; otherwise (an unusual decoder) keep the longer window.
        if len(tail_text) < unsent or not text.endswith(tail_text.lstrip(REPLACEMENT_CHAR)):
            return
        self._ids = tail
        self._read = 0
        self._sent = len(tail_text) - unsent

    def finish(self) -> str:
        """Flush held-back text at end of stream (an incomplete character comes out
        as U+FFFD, exactly as a full decode shows it)."""
        text = self._decode(self._ids)
        delta = text[self._sent :]
        self._sent = len(text)
        return delta
