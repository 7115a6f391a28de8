def chat_prompts(tokenizer, n):
    topics = ["the moon", "binary search", "a cat", "Paris", "prime numbers", "rain", "the ocean", "chess",
              "a bicycle", "volcanoes", "music", "bread", "the stock market", "sleep", "a robot", "winter"]
    return [tokenizer.apply_chat_template([{"role": "user", "content": f"Tell me about {topics[i % len(topics)]}."}],
                                          add_generation_prompt=True, tokenize=True, return_dict=False)
            for i in range(n)]
