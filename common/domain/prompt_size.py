"""Refusing at submission a request whose prompt cannot fit the served model's context.

A worker would tokenize it only to fail it, and a job of many thousands of messages would hold the worker's CPU
a long time to do so. Two checks:

- plain caps on every request, whatever is known of the model: content parts (`max_job_messages`, a message
  whose content is a string is one part) and characters of text (`max_job_text_chars`);
- where the served model's files are readable here (common/domain/served_model.py), a lower bound of the prompt's
  tokens against its context: the text parts tokenized one by one, nothing counted for the chat template and
  one token per image, so a prompt refused here is one the worker would refuse too. A prompt that leaves
  room for at least one output token passes; max_tokens beyond the room left is cut there by the worker
  (finish_reason "length"), as before.

Most prompts are far shorter than the context: when even the most tokens the text could become stay below it,
nothing is tokenized.
"""

from __future__ import annotations

from common.domain.schemas import ChatCompletionRequest, TextPart
from common.domain.served_model import ServedModel, served_model
from common.domain.submission_error import SubmissionError
from common.infra.settings import Settings

# A text part is tokenized alone, the worker tokenizes it inside the chat template: where the part meets the
# template's text (or the next part), the words on either side of the join may merge into fewer tokens. Those
# words' tokens are not counted; where the tokenizer does not split text into words, this many per part.
JOIN_SLACK_TOKENS = 8
# A long text is first tokenized this many characters per token still needed (then 4 times as many, ...).
PREFIX_CHARS_PER_TOKEN = 8


def check_prompt_size(req: ChatCompletionRequest, settings: Settings, model: str | None) -> None:
    """Raise SubmissionError for a request over the caps, or whose prompt cannot fit `model`'s context
    (`model`: where the served model's files are; None: unknown here, caps only)."""
    texts: list[str] = []
    parts = images = chars = wide_bytes = 0
    for message in req.messages:
        content = message.content
        if isinstance(content, str):
            parts += 1
            texts.append(content)
            continue
        parts += len(content) or 1
        for part in content:
            if isinstance(part, TextPart):
                texts.append(part.text)
            else:
                images += 1
    for text in texts:
        chars += len(text)
        if not text.isascii():
            wide_bytes += len(text.encode("utf-8", "surrogatepass")) - len(text)
    if parts > settings.max_job_messages:
        raise SubmissionError(
            f"the request has {parts:,} messages and content parts; this server takes at most "
            f"{settings.max_job_messages:,} (VLMQ_MAX_JOB_MESSAGES)", 400, "too_many_messages", param="messages")
    if chars > settings.max_job_text_chars:
        raise SubmissionError(
            f"the request's text is {chars:,} characters; this server takes at most "
            f"{settings.max_job_text_chars:,} (VLMQ_MAX_JOB_TEXT_CHARS)", 400, "text_too_long", param="messages")
    if model is None:
        return
    served = served_model(model)
    context = served.context_tokens
    if context is None or served.tokenizer is None:
        return
    # Every token covers at least one byte of the (normalised) text, bar the prefix a part may get.
    if served.tokens_per_byte * (chars + wide_bytes) + len(texts) + images < context:
        return
    least = _least_tokens(served, texts, images, context)
    if least >= context:
        raise SubmissionError(
            f"the prompt is at least {least:,} tokens (text and images); model {settings.served_model_name!r} "
            f"has a context of {context:,} tokens, prompt and output together, so it takes at most "
            f"{context - 1:,} prompt tokens", 400, "context_length_exceeded", param="messages")


def _least_tokens(served: ServedModel, texts: list[str], images: int, context: int) -> int:
    """A lower bound of the prompt's tokens, counted until it reaches `context`. A long text is tokenized by
    growing prefixes: a prefix's count is a lower bound of the whole text's, so a text of a million characters
    costs about as much as the context's worth of it."""
    least = images
    for text in texts:
        stripped = text.strip()
        length = PREFIX_CHARS_PER_TOKEN * (context - least + JOIN_SLACK_TOKENS)
        while True:
            count = _least_in(served, stripped[:length])
            if least + count >= context or length >= len(stripped):
                break
            length *= 4
        least += count
        if least >= context:
            break
    return least


def _least_in(served: ServedModel, text: str) -> int:
    """The tokens of `text` that no join with the text around it can change."""
    if not text:
        return 0
    assert served.tokenizer is not None  # check_prompt_size counts only with a tokenizer
    words = served.tokenizer.encode(text, add_special_tokens=False).word_ids
    if not words:
        return 0
    first, last = words[0], words[-1]
    if first == last:
        return max(0, len(words) - JOIN_SLACK_TOKENS)
    return sum(1 for w in words if w != first and w != last)
