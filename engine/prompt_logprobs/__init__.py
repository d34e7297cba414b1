"""Prompt logprobs (vLLM's `prompt_logprobs`, OpenAI's `echo` with `logprobs`): the model's score of
every prompt token given the tokens before it, computed in the steps that run the prompt.

- `values.PromptLogprobs`: one request's scores on the host (flat lists: entry i is prompt token i+1).
- `tracker.PromptLogprobsTracker`: which requests still need scores, each step's extra logits rows
  (`StepRows`), the device math on each slice of those rows, and the scores once complete.
- `slices.sliced_logits`: the runner's lm_head over sampled + extra rows, a bounded slice at a time.

Cost falls only on requests that ask: with none pending the engine checks one empty dict per step
and the runner takes its usual path; a request that asks computes logits for its own prompt rows
and skips the prefix cache lookup (its hidden states must be computed anyway; see `tracker`).
"""

from engine.prompt_logprobs.slices import sliced_logits
from engine.prompt_logprobs.tracker import PromptLogprobsTracker, StepRows
from engine.prompt_logprobs.values import PromptLogprobs

__all__ = ["PromptLogprobs", "PromptLogprobsTracker", "StepRows", "sliced_logits"]
