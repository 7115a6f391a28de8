"""The speculative step: sampling rules, propose (drafter), verify (rejection sampling), k controller."""
