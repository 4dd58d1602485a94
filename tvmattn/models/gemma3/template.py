"""Gemma 3's chat template, for GGUF files that carry none (tokenizer.chat_template absent, as in
the packaged Gemma 3 270M): Gemma's turn format, a system message folded into the first user
turn as Gemma's own template does. It writes <bos> itself: tvmattn.generate renders templates
with an empty bos_token and encodes the result without adding special tokens."""

CHAT_TEMPLATE = (
    "<bos>"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set prefix = messages[0]['content'] + '\\n\\n' -%}{%- set turns = messages[1:] -%}"
    "{%- else -%}{%- set prefix = '' -%}{%- set turns = messages -%}{%- endif -%}"
    "{%- for message in turns -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\\n' + (prefix if loop.first else '') + message['content'] | trim"
    " + '<end_of_turn>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"
)
# tokens that end an answer besides the GGUF's eos
STOP_TOKENS = ("<end_of_turn>",)
