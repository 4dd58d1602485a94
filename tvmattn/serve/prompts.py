"""Prompts of the serving API: OpenAI chat messages checked and rendered with the model's chat
template, and completion prompts (text or token ids) turned into token ids."""

from __future__ import annotations

from typing import Any

ROLES = ("system", "user", "assistant", "developer", "tool")


class PromptError(ValueError):
    """A malformed prompt or message list; `param` names the field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def message_text(content: Any, where: str) -> str:
    """A message's content: a string, or a list of {"type": "text", "text": ...} parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise PromptError(f"{where}.content[{i}] must be a text part {{'type': 'text', 'text': ...}} "
                                  f"(only text is supported)", f"{where}.content")
            texts.append(part["text"])
        return "".join(texts)
    if content is None:
        return ""
    raise PromptError(f"{where}.content must be a string or a list of text parts", f"{where}.content")


def normalize_messages(messages: Any) -> list[dict[str, str]]:
    if not isinstance(messages, list) or not messages:
        raise PromptError("messages must be a non-empty list", "messages")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise PromptError(f"{where} must be an object with 'role' and 'content'", where)
        role = message.get("role")
        if role not in ROLES:
            raise PromptError(f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}", f"{where}.role")
        out.append({"role": "system" if role == "developer" else role,
                    "content": message_text(message.get("content"), where)})
    return out


def render_messages(template: str | None, messages: list[dict[str, str]], bos: str = "", eos: str = "") -> str:
    """The chat template applied to the messages, with the assistant's generation prompt
    (no template: the contents joined by newlines)."""
    if not template:
        return "\n".join(m["content"] for m in messages) + "\n"
    import jinja2

    env = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
    try:
        return env.from_string(template).render(messages=messages, add_generation_prompt=True, bos_token=bos,
                                                eos_token=eos)
    except jinja2.TemplateError as err:
        raise PromptError(f"the model's chat template does not render these messages ({err})", "messages") from None


def completion_prompt(prompt: Any, encode) -> list[int]:
    """/v1/completions' prompt: a string, a list of one string, or token ids (a list of ints, or
    a list of one such list) -> token ids."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise PromptError("prompt must not be empty", "prompt")
        return encode(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt)
    raise PromptError("prompt must be a non-empty string or a list of token ids (one prompt: n = 1 and no "
                      "batches)", "prompt")
