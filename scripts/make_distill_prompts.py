"""Write offload_engine/data/distill_prompts.jsonl: the default prompt list `distill` answers
with the target to make on-policy training text. Templates crossed with subjects (writing,
explaining, question answering, reasoning with numbers, coding, summarising, advice, planning),
shuffled with a fixed seed.

Kept apart from benchmarks/prompts.jsonl (the held-out set on which acceptance is measured):
no prompt equals one of them, and no subject or fixed prompt is used whose keywords (words of
five letters or more, less instruction words such as "write" or "explain") occur in any of them, so "How do vaccines work?" there has no "Explain vaccines ..." here.

    python scripts/make_distill_prompts.py
"""

import json
import random
import re
from pathlib import Path

TOPICS = [
    "volcanoes", "honeybees", "the moon landing", "the Roman Empire", "electric cars", "coffee",
    "friendship", "a rainy afternoon", "the printing press", "black holes", "recycling", "the human heart",
    "the internet", "autumn leaves", "machine learning", "gardening", "ancient Egypt", "a city at night",
    "mountain climbing", "jazz music", "the Great Wall of China", "solar panels", "dinosaurs", "sleep",
    "a lost cat", "the stock market", "bread baking", "earthquakes", "rainforests", "robots",
    "the solar system", "public libraries", "bicycles", "time management", "a first job", "the Olympic Games",
    "penguins", "smartphones", "renewable energy", "Shakespeare", "the immune system", "deserts",
    "a train journey", "kindness", "video games", "glaciers", "the Renaissance", "clouds", "saving money",
    "octopuses", "the Industrial Revolution", "quantum computers", "bees and flowers", "an old bookshop",
    "the Silk Road", "thunderstorms", "the Amazon river", "elephants", "a village festival", "space travel",
    "the Eiffel Tower", "board games", "origami", "migrating birds", "coral reefs", "the Vikings",
    "wind turbines", "a snowy mountain cabin", "street food", "the periodic table", "tigers", "knitting",
    "the Moon", "Mars", "the Sahara", "a marathon", "the violin", "photography", "the Titanic", "castles",
    "hot air balloons", "the printing of money", "antibiotics", "the brain", "artificial intelligence",
    "democracy", "the Pyramids of Giza", "a childhood memory", "a busy kitchen", "a haunted house",
    "the Arctic", "wolves", "the night sky", "a garden in spring", "submarines", "the Wright brothers",
    "Leonardo da Vinci", "Marie Curie", "the Beatles", "skateboarding", "camping", "a farmers market",
    "the Mediterranean diet", "urban gardens", "electricity", "magnets", "rainbows", "tides", "the wind",
    "a rocket launch", "a detective", "a dragon", "a robot learning to paint", "a talking tree",
    "a school science fair", "dogs", "cats", "horses", "owls", "whales", "butterflies", "mushrooms",
    "chocolate", "pizza", "rice", "tomatoes", "cheese making", "a museum visit", "a long flight",
    "public transport", "bridges", "skyscrapers", "the metric system", "calendars", "clocks",
    "the alphabet", "poetry", "libraries of the future", "a quiet morning", "a thunderous waterfall",
    "a lighthouse in a storm", "teamwork", "patience", "curiosity", "honesty", "courage",
]
WRITING = [
    "Write a short poem about {t}.", "Write a haiku about {t}.", "Write a short story about {t}.",
    "Write a limerick about {t}.", "Write a paragraph describing {t}.", "Write a tweet about {t}.",
    "Write a short speech about {t}.", "Write a diary entry about {t}.", "Write a dialogue between two friends "
    "about {t}.", "Write an opening line for a novel about {t}.", "Write a product description inspired by {t}.",
    "Write a short motivational message that mentions {t}.", "Write a four-line rhyme about {t}.",
    "Write a children's story about {t} in five sentences.", "Write a news headline and a short article about {t}.",
    "Write a riddle whose answer is {t}.", "Write a short blog post introduction about {t}.",
    "Write a song chorus about {t}.", "Write a postcard from a trip involving {t}.",
    "Describe {t} using all five senses.", "Write a short scene set during {t}.",
]
EXPLAIN = [
    "Explain {t} to a ten-year-old.", "What are three interesting facts about {t}?",
    "Give me a brief overview of {t}.", "Why is {t} important?", "Summarize the key ideas about {t}.",
    "List five questions a student might ask about {t}.", "What are the pros and cons of {t}?",
    "Describe {t} in three sentences.", "What is a common misconception about {t}?",
    "How would you teach a class about {t}?", "Give me a fun quiz question about {t}.", "Compare {t} and {u}.",
    "What can we learn from {t}?", "Explain the history of {t} briefly.", "Suggest a title for an essay about {t}.",
    "What would the world be like without {t}?", "Tell me something surprising about {t}.",
    "Write an outline for a presentation about {t}.", "What questions do scientists still ask about {t}?",
    "Summarise what a beginner should know about {t}.", "Give a one-paragraph summary of {t}.",
    "In two sentences, what is {t}?", "What do {t} and {u} have in common?",
]
QUESTIONS = [
    "What is the capital of France?", "What is the capital of Canada?", "What is the capital of Australia?",
    "What is the capital of Brazil?", "What is the capital of Egypt?", "What is the capital of Germany?",
    "Who painted the Mona Lisa?", "Who was Albert Einstein?", "Who invented the telephone?",
    "Who wrote Hamlet?", "Who wrote The Odyssey?", "Who was Cleopatra?", "Who discovered penicillin?",
    "How does a rainbow form?", "How do airplanes stay in the air?", "How does a compass work?",
    "How do plants drink water?", "How does the heart pump blood?", "How do batteries store energy?",
    "How do birds know where to migrate?", "How is glass made?", "How does soap clean things?",
    "Why do leaves change colour in autumn?", "Why do we dream?", "Why is the ocean salty?",
    "Why do cats purr?", "Why do we have leap years?", "Why does ice float?", "Why do stars twinkle?",
    "What is gravity?", "What is inflation?", "What is a black hole?", "What is DNA?", "What is an atom?",
    "What is the speed of light?", "What is a noun?", "What is a democracy?", "What is a volcano?",
    "What is the difference between a virus and a bacterium?", "What is the difference between a lake "
    "and a pond?", "What is the difference between speed and velocity?", "What is the difference between "
    "a simile and a metaphor?", "What is the difference between an alligator and a crocodile?",
    "How many planets are in the solar system?", "How many bones are in the human body?",
    "How long does it take light from the Sun to reach Earth?", "What language is spoken in Brazil?",
    "What is the largest ocean on Earth?", "What is the tallest mountain in the world?",
    "What is the longest river in Africa?", "What does a thermometer measure?",
]
CODING = [
    "Write a Python function that {c}.", "How do I {c} in Python?", "Explain how to {c} in JavaScript.",
    "Write a C function that {c}.", "What is an efficient algorithm to {c}?", "Write a Java method that {c}.",
    "Write a Rust function that {c}.", "Show me a short Python example that {c}, with comments.",
]
TASKS = [
    "counts the vowels in a sentence", "sorts a list of words by length", "computes a factorial",
    "removes duplicates from a list", "reads a file line by line", "merges two sorted lists",
    "converts Celsius to Fahrenheit", "checks if a word is a palindrome", "computes the Fibonacci numbers",
    "finds the average of a list", "counts word frequencies in a text", "flattens a nested list",
    "validates an email address", "computes the greatest common divisor", "generates a random password",
    "capitalizes every word in a sentence", "finds the second smallest element", "checks for balanced "
    "parentheses", "converts a binary string to an integer", "rotates a matrix by 90 degrees",
    "finds all anagrams of a word in a list", "computes the sum of the digits of a number",
    "implements binary search", "implements a stack", "implements a queue with two stacks",
    "parses a CSV line", "counts the lines in a file", "finds the most common character",
    "checks whether a year is a leap year", "computes the power of a number", "splits a list into chunks",
]
TECH = [
    "Explain what a linked list is.", "What is recursion? Give an example.", "What does the `ls` command do?",
    "What is the difference between `==` and `is` in Python?", "What is a REST API?", "Explain Big-O notation.",
    "What is a SQL join?", "What is object-oriented programming?", "Explain what a compiler does.",
    "What does `git commit` do?", "What is the difference between HTTP and HTTPS?", "What is a variable?",
    "Explain what a dictionary is in Python.", "What is a for loop?", "What is unit testing?",
    "Write a SQL query that finds the ten most recent orders.", "Write a SQL query that lists customers "
    "without orders.", "Write a bash command that finds the largest file in a folder.",
    "What does `grep` do?", "What is version control and why use it?", "Explain what JSON is.",
    "What is a function in programming?", "What is the difference between a class and an object?",
]
MATH = [
    "What is {a} plus {b}?", "What is {a} times {b}?", "If a car travels {a} km in {b} hours, what is its "
    "average speed?", "A shop sells pears at {b} dollars each. How much do {a} pears cost?",
    "What is {a} percent of {c}?", "Is {c} an even or odd number? Explain.", "What is {c} minus {a}?",
    "What is {c} divided by {b}?", "A class has {a} students split into groups of {b}. How many full groups "
    "are there?", "Tom has {a} marbles and gives away {b}. How many are left?", "What is the square of {b}?",
    "If a book costs {a} dollars and is {b}0% off, what is the sale price?", "Round {c}.{b} to the nearest "
    "whole number.", "A rectangle is {a} m long and {b} m wide. What is its area?",
    "A bus leaves at {b} am and the trip takes {a} minutes. When does it arrive?",
    "What number comes next: {b}, {d}, {e}, ...?", "Sam is {a} years old. How old will Sam be in {b} years?",
]
PUZZLES = [
    "A bat and a ball cost 1.10 dollars in total. The bat costs one dollar more than the ball. How much is "
    "the ball?", "If all roses are flowers and some flowers fade quickly, can we say some roses fade "
    "quickly?", "Which is longer, a week or 100 hours?", "If today is Monday, what day is it in 10 days?",
    "Is zero an even number? Explain.", "What is heavier, a tonne of bricks or a tonne of cotton?",
    "How many months have 28 days?", "If you have two coins that add up to 30 cents and one is not a "
    "nickel, what are they?", "Explain why multiplying two negative numbers gives a positive number.",
    "Why is any number divided by itself equal to one?", "Explain why the sum of two even numbers is even.",
]
WRITING_TASKS = [
    "Write a polite email asking my manager for a day off.", "Write an email to a landlord about a "
    "broken heater.", "Write a short apology note to a friend for missing their party.",
    "Write a cover letter opening for a job at a bookstore.", "Write a birthday message for my grandmother.",
    "Write a short review of a pizza restaurant.", "Write an invitation to a neighbourhood picnic.",
    "Write a text message reminding a friend about our meeting tomorrow.", "Write a short bio for a "
    "photographer's website.", "Write a welcome message for new members of a hiking club.",
    "Write a short advertisement for a used bicycle.", "Write a note congratulating a coworker on a "
    "promotion.", "Write a formal complaint about a late delivery.", "Write a slogan for a recycling "
    "campaign.", "Write a get-well-soon card message.", "Write a short toast for a wedding.",
]
ADVICE = [
    "How can I get better at {s}?", "Give me tips for {s}.", "What are common mistakes when {s}?",
    "Make a one-week plan for {s}.", "What should a beginner know about {s}?",
    "How do I stay motivated when {s}?",
]
SKILLS = [
    "public speaking", "cooking for one", "studying for exams", "running a 5k", "writing emails",
    "keeping a journal", "learning to draw", "managing stress", "saving for a trip", "making new friends",
    "waking up early", "reading more books", "job interviews", "organizing my desk", "learning guitar",
    "learning to swim", "growing tomatoes", "learning Spanish", "working from home", "baking bread",
    "taking photos with a phone", "meditating", "painting with watercolours", "playing chess",
]
PLACES = ["Paris", "Tokyo", "Lisbon", "Cairo", "New York", "Barcelona", "Kyoto", "Prague", "Istanbul",
          "Edinburgh", "Vienna", "Mexico City", "Sydney", "Berlin", "Amsterdam", "Marrakech"]
TRAVEL = [
    "Plan a {n}-day trip to {p} for someone who loves food.", "What should I see on a weekend in {p}?",
    "Give me a packing list for a trip to {p}.", "Describe a day in {p} through the eyes of a tourist.",
    "What are three things to know before visiting {p}?",
]


# instruction and function words: sharing one of these does not make two prompts alike
GENERIC = {"write", "short", "explain", "about", "which", "whether", "every", "first", "number", "numbers",
           "difference", "between", "python", "function", "sentence", "sentences", "finds", "counts", "string",
           "lines", "command", "email", "letter", "opening", "hours", "words", "there", "their", "would",
           "should", "three", "language"}


def _keywords(text: str) -> set[str]:
    return {w for w in re.findall(r"[a-z]+", text.lower()) if len(w) >= 5} - GENERIC


def main() -> None:
    rng = random.Random(20261130)
    held_out = [json.loads(line)["messages"][-1]["content"]
                for line in Path("benchmarks/prompts.jsonl").read_text().splitlines() if line.strip()]
    held_words = set().union(*(_keywords(p) for p in held_out))

    def fresh(subjects):  # subjects none of whose keywords the held-out prompts use
        return [s for s in subjects if not (_keywords(s) & held_words)]

    topics, tasks, skills, places = fresh(TOPICS), fresh(TASKS), fresh(SKILLS), fresh(PLACES)
    prompts = set()
    for t in topics:
        for tpl in WRITING + EXPLAIN:
            prompts.add(tpl.format(t=t, u=rng.choice([u for u in topics if u != t])))
    for c in tasks:
        for tpl in CODING:
            prompts.add(tpl.format(c=c))
    for _ in range(600):
        a, b, c = rng.randint(2, 99), rng.randint(2, 12), rng.randint(10, 999)
        prompts.add(rng.choice(MATH).format(a=a, b=b, c=c, d=2 * b, e=3 * b))
    for s in skills:
        for tpl in ADVICE:
            prompts.add(tpl.format(s=s))
    for p in places:
        for tpl in TRAVEL:
            prompts.add(tpl.format(p=p, n=rng.randint(2, 5)))
    prompts.update(fresh(QUESTIONS + TECH + PUZZLES + WRITING_TASKS))
    prompts = sorted(prompts - set(held_out))
    rng.shuffle(prompts)
    out = Path("offload_engine/data/distill_prompts.jsonl")
    out.write_text("".join(json.dumps({"messages": [{"role": "user", "content": p}]}) + "\n" for p in prompts))
    print(f"{len(prompts)} prompts -> {out} ({len(topics)} topics, {len(tasks)} coding tasks, "
          f"{len(TOPICS) - len(topics) + len(TASKS) - len(tasks)} subjects dropped as too close to the held-out set)")


if __name__ == "__main__":
    main()
