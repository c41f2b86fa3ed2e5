"""The worker protocol's size limits, checked where a message is parsed.

Whoever reaches a worker port can send any value, and each of these sizes a forward pass, a sampling step or a
response; a value beyond its limit is INVALID_ARGUMENT naming the field. The coordinator's own settings stay
within them (CoordinatorConfig checks its gamma and p entries against these at start-up).
"""

MAX_STEP_TOKENS = 32  # tokens a step drafts (draft: num_tokens) or verifies (target: draft_token_ids)
MAX_P_ENTRIES = 64  # num_p_entries: the top entries of p a target returns per position
MAX_Q_ENTRIES = 1024  # max_q_entries of a draft session, and the entries of each q a target receives
MAX_TOP_LOGPROBS = 20  # start.logprobs: the likeliest tokens a target reports per position (OpenAI's top_logprobs)
