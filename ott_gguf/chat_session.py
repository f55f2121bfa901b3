"""A chat conversation held in one sequence of the KV cache (the `chat` command's engine)."""

from __future__ import annotations

from .errors import ContextFullError


class ChatSession:
    """A conversation kept in sequence 0 of the KV cache.

    Each turn renders the whole conversation with the chat template, keeps the cached tokens
    it shares as a prefix and evaluates only the rest (the new user message, or everything
    after the first difference). When the conversation plus room for a reply outgrows the
    context, the oldest user/assistant turns are dropped (a system message stays).
    """

    def __init__(self, model, sampling, max_reply: int, system: str | None = None, seq: int = 0):
        from .sampling import Sampler

        self.model = model
        self.sampler = Sampler(sampling)
        self.max_reply = max_reply
        self.seq = seq
        self.messages = [{"role": "system", "content": system}] if system else []
        self.cached: list[int] = []  # the tokens in sequence `seq`, in order

    def reply(self, text: str):
        """Stream the assistant's answer to the user message `text`; remember both."""
        from .generate import generate_tokens, stream_text

        self.messages.append({"role": "user", "content": text})
        try:
            ids = self._prompt_ids()
        except ContextFullError:
            self.messages.pop()
            raise
        n_keep = 0  # the cached prefix the new prompt shares
        while n_keep < min(len(self.cached), len(ids)) and self.cached[n_keep] == ids[n_keep]:
            n_keep += 1
        generated = []

        def record():
            for tok in generate_tokens(self.model, ids, self.max_reply, self.sampler, self.seq, n_keep):
                generated.append(tok)
                yield tok

        yield from stream_text(self.model.tokenizer, record())
        self.messages.append({"role": "assistant", "content": self.model.detokenize(generated)})
        self.cached = (ids + generated)[: self.model.seq_len(self.seq)]

    def _prompt_ids(self) -> list[int]:
        model = self.model
        first_turn = 1 if self.messages[0]["role"] == "system" else 0
        messages = list(self.messages)  # trimmed here; kept only if the new message fits
        while True:
            ids = chat_prompt_ids(model, messages)
            if len(ids) + self.max_reply <= model.n_ctx:
                self.messages = messages
                return ids
            if len(messages) - first_turn <= 1:
                raise ContextFullError(
                    f"chat: the message needs {len(ids)} tokens plus {self.max_reply} for the "
                    f"reply, the context holds {model.n_ctx} (raise -c or lower -n)"
                )
            del messages[first_turn : first_turn + 2]  # the oldest user message and its reply


def chat_prompt_ids(model, messages: list[dict]) -> list[int]:
    """Token ids of a conversation rendered with the model's chat template, ready for the
    assistant's reply. The template writes its own special tokens (as transformers assumes);
    the messages' text is tokenized with special tokens off, so it cannot forge them. BOS is
    added only when the vocabulary wants one and the template did not write it."""
    parts = model.chat_template.render_parts(messages, add_generation_prompt=True)
    ids = model.tokenizer.encode_parts(parts, add_special=False)
    if model.tokenizer.add_bos and ids[:1] != [model.tokenizer.bos_id]:
        ids.insert(0, model.tokenizer.bos_id)
    return ids
