"""The project's own prompt sets (code, math, chat, structured) for traffic replay and held-out evaluation."""

from specrl.data.prompts import DOMAINS, SPLITS, Prompt, PromptMix, as_messages, chat_token_ids, load_prompts

__all__ = ["DOMAINS", "SPLITS", "Prompt", "PromptMix", "as_messages", "chat_token_ids", "load_prompts"]
