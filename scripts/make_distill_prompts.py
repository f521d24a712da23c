"""Write offload_engine/data/distill_prompts.jsonl: the default prompt list `distill` answers
with the target to make on-policy training text. Templates crossed with topics, shuffled with a
fixed seed; none of them is a prompt of benchmarks/prompts.jsonl (the held-out set).

    python scripts/make_distill_prompts.py
"""

import json
import random
from pathlib import Path

TOPICS = [
    "the ocean", "volcanoes", "honeybees", "the moon landing", "photosynthesis", "the Roman Empire",
    "electric cars", "coffee", "friendship", "a rainy afternoon", "the printing press", "black holes",
    "recycling", "the human heart", "climate change", "chess", "the internet", "autumn leaves",
    "a lighthouse keeper", "machine learning", "gardening", "the water cycle", "ancient Egypt",
    "a city at night", "mountain climbing", "vaccines", "jazz music", "the Great Wall of China",
    "solar panels", "dinosaurs", "sleep", "a lost cat", "the stock market", "bread baking",
    "earthquakes", "the French Revolution", "rainforests", "learning a new language", "robots",
    "the solar system", "public libraries", "bicycles", "time management", "a first job",
    "the Olympic Games", "penguins", "smartphones", "renewable energy", "Shakespeare", "tea",
    "the immune system", "deserts", "a train journey", "kindness", "video games", "glaciers",
    "the Renaissance", "clouds", "a small bakery", "saving money",
]
TEMPLATES = [
    "Write a short poem about {t}.", "Write a haiku about {t}.", "Write a short story about {t}.",
    "Explain {t} to a ten-year-old.", "What are three interesting facts about {t}?",
    "Give me a brief overview of {t}.", "Why is {t} important?", "Summarize the key ideas about {t}.",
    "Write a paragraph describing {t}.", "List five questions a student might ask about {t}.",
    "What are the pros and cons of {t}?", "Write a tweet about {t}.", "Describe {t} in three sentences.",
    "Write a short speech about {t}.", "What is a common misconception about {t}?",
    "Write a limerick about {t}.", "How would you teach a class about {t}?",
    "Write a product description inspired by {t}.", "Give me a fun quiz question about {t}.",
    "Write a diary entry about {t}.", "Compare {t} and {u}.", "Write a dialogue between two friends about {t}.",
    "What can we learn from {t}?", "Write an opening line for a novel about {t}.",
    "Explain the history of {t} briefly.", "Suggest a title for an essay about {t}.",
    "Write a short motivational message that mentions {t}.", "What would the world be like without {t}?",
]
CODING = [
    "Write a Python function that {c}.", "How do I {c} in Python?", "Explain how to {c} in JavaScript.",
    "Write a C function that {c}.", "What is an efficient algorithm to {c}?",
]
TASKS = [
    "reverses a string", "checks whether a number is prime", "counts the vowels in a sentence",
    "finds the largest number in a list", "sorts a list of words by length", "computes a factorial",
    "removes duplicates from a list", "reads a file line by line", "merges two sorted lists",
    "converts Celsius to Fahrenheit", "checks if a word is a palindrome", "computes the Fibonacci numbers",
    "finds the average of a list", "counts word frequencies in a text", "flattens a nested list",
    "validates an email address", "computes the greatest common divisor", "generates a random password",
]
MATH = [
    "What is {a} plus {b}?", "What is {a} times {b}?", "If a train travels {a} km in {b} hours, what is its "
    "average speed?", "A shop sells apples at {b} dollars each. How much do {a} apples cost?",
    "What is {a} percent of {c}?", "Is {c} an even or odd number? Explain.",
]
ADVICE = [
    "How can I get better at {s}?", "Give me tips for {s}.", "What are common mistakes when {s}?",
    "Make a one-week plan for {s}.",
]
SKILLS = [
    "public speaking", "cooking for one", "studying for exams", "running a 5k", "writing emails",
    "keeping a journal", "learning to draw", "managing stress", "saving for a trip", "making new friends",
    "waking up early", "reading more books", "job interviews", "organizing my desk", "learning guitar",
]


def main() -> None:
    rng = random.Random(20261130)
    prompts = set()
    for t in TOPICS:
        for tpl in TEMPLATES:
            prompts.add(tpl.format(t=t, u=rng.choice([u for u in TOPICS if u != t])))
    for c in TASKS:
        for tpl in CODING:
            prompts.add(tpl.format(c=c))
    for _ in range(150):
        prompts.add(rng.choice(MATH).format(a=rng.randint(2, 99), b=rng.randint(2, 12), c=rng.randint(10, 999)))
    for s in SKILLS:
        for tpl in ADVICE:
            prompts.add(tpl.format(s=s))
    held_out = {json.loads(line)["messages"][-1]["content"]
                for line in Path("benchmarks/prompts.jsonl").read_text().splitlines() if line.strip()}
    prompts = sorted(prompts - held_out)
    rng.shuffle(prompts)
    out = Path("offload_engine/data/distill_prompts.jsonl")
    out.write_text("".join(json.dumps({"messages": [{"role": "user", "content": p}]}) + "\n" for p in prompts))
    print(f"{len(prompts)} prompts -> {out}")


if __name__ == "__main__":
    main()
