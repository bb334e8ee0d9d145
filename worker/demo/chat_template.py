"""The demo model's chat template: each turn's text, then its images, whatever order the parts came in.

The demo model learnt on one layout of the user's turn, the question before the picture (worker/demo/train.py
says why a model this small needs it), and answered a picture sent first at chance on shapes and colours: a
multipart job (`vlmq submit -i star.png "What colour is the star?"`) puts its images first. Its template fixes
the layout, as LLaVA-1.5's conversation format fixes where the image goes in a turn, so any order of parts
reaches the model as the layout it knows. Images keep their order among themselves, as do texts.
"""

from __future__ import annotations

from pathlib import Path

from worker.inference.tiny_model import IMAGE_TOKEN

DEMO_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}"
    "{% for part in message['content'] if part['type'] == 'text' %}{{ part['text'] }}{% endfor %}"
    "{% for part in message['content'] if part['type'] == 'image' %}" + IMAGE_TOKEN + "{% endfor %}"
    "{% endif %}"
    "{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}\n{% endif %}"
)


def write_chat_template(model_dir: Path) -> None:
    """Make `model_dir`'s processor render prompts with the demo's template (read from this file at load)."""
    (Path(model_dir) / "chat_template.jinja").write_text(DEMO_CHAT_TEMPLATE, encoding="utf-8")
