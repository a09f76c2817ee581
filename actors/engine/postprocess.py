"""What one sampled token does to its sequence: the one place stop conditions are decided.

In order: a stop string completed by the token's text (the detokenizer's matcher), a stop token id or
end-of-sequence once `min_tokens` are out, the structured-output grammar's end (or its spent budget: FAILED,
structured.py), then the length limits. When the sequence ends for any
reason but a stop string, the text the matcher held back is released.
"""

from __future__ import annotations

from actors.engine.sequence import Sequence
from actors.protocol.request_status import RequestStatus


def append_token(seq: Sequence, token: int, eos_token_ids: set[int], max_model_len: int) -> tuple[RequestStatus | None, str]:
    """Append `token` to `seq`; returns the finished status (None: it goes on) and the new text.
    Sets `seq.stop_reason` to the stop string or stop token that ended it."""
    seq.output_token_ids.append(token)
    if seq.grammar is not None and not seq.grammar.accept(token):
        # The mask allowed only tokens the grammar takes, so this is a bug: end the output where it is.
        seq.stop_reason = "structured output: the grammar refused a sampled token"
        return RequestStatus.FINISHED_STOPPED, ""
    if seq.status == RequestStatus.PREFILLING:
        seq.status = RequestStatus.DECODING
    params = seq.params
    new_text = ""
    status = None
    if seq.detokenizer is not None:
        detok = seq.detokenizer.add_tokens([token])
        new_text = detok.new_text
        if detok.stop_hit is not None:
            status, seq.stop_reason = RequestStatus.FINISHED_STOPPED, detok.stop_hit
    n_out = len(seq.output_token_ids)
    if status is None and n_out >= params.min_tokens:
        if token in params.stop_token_ids:
            status, seq.stop_reason = RequestStatus.FINISHED_STOPPED, token
        elif token in eos_token_ids and not params.ignore_eos:
            status = RequestStatus.FINISHED_STOPPED
    if status is None and seq.grammar is not None and seq.grammar.terminated:
        status = RequestStatus.FINISHED_STOPPED  # the output is complete: it took the grammar's stop token
    if status is None and seq.grammar is not None and seq.grammar.failure is not None:
        status, seq.stop_reason = RequestStatus.FAILED, seq.grammar.failure  # its grammar's budget is spent
    if status is None and (n_out >= params.max_tokens or seq.num_tokens >= max_model_len):
        status = RequestStatus.FINISHED_LENGTH
    if status is not None and seq.detokenizer is not None and not isinstance(seq.stop_reason, str):
        new_text += seq.detokenizer.flush()  # no stop string matched: release the held-back text
    return status, new_text
