"""vLLM's TokensPrompt: a prompt given as token ids."""


def TokensPrompt(prompt_token_ids: list[int]) -> dict:  # noqa: N802 (vLLM's name)
    return {"prompt_token_ids": prompt_token_ids}
