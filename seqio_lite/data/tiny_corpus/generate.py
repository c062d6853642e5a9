"""Generates seqio_lite/data/tiny_corpus: small fable-like stories from a fixed grammar."""

import os
import random

rng = random.Random(20240611)
animals = [
    "fox",
    "crow",
    "hare",
    "tortoise",
    "lion",
    "mouse",
    "wolf",
    "lamb",
    "ant",
    "grasshopper",
    "dog",
    "cat",
    "goat",
    "owl",
    "frog",
    "stork",
    "bear",
    "deer",
    "horse",
    "donkey",
    "heron",
    "crab",
    "bee",
    "dove",
]
places = [
    "by the river",
    "in the old forest",
    "at the edge of the field",
    "on the hill",
    "near the mill",
    "under the oak tree",
    "in the meadow",
    "beside the well",
    "at the farm",
    "in the valley",
]
adjs = [
    "clever",
    "proud",
    "hungry",
    "patient",
    "lazy",
    "kind",
    "greedy",
    "brave",
    "foolish",
    "wise",
    "quick",
    "gentle",
    "tired",
    "curious",
]
times = [
    "One morning",
    "Long ago",
    "On a cold winter day",
    "In the heat of summer",
    "One evening",
    "At dawn",
    "When the rain had stopped",
    "Late one autumn night",
]
verbs = [
    "found",
    "lost",
    "wanted",
    "carried",
    "hid",
    "shared",
    "stole",
    "guarded",
    "praised",
    "mocked",
]
things = [
    "a piece of cheese",
    "a bunch of grapes",
    "a bag of grain",
    "a golden key",
    "a ripe apple",
    "a loaf of bread",
    "a shiny stone",
    "a jar of honey",
    "a warm blanket",
    "a small boat",
]
morals = [
    "Slow and steady wins the race.",
    "Do not count your chickens before they are hatched.",
    "Pride goes before a fall.",
    "A friend in need is a friend indeed.",
    "It is wise to prepare today for the wants of tomorrow.",
    "Little by little does the trick.",
    "Appearances are often deceiving.",
    "Kindness is never wasted.",
    "Greed often overreaches itself.",
    "Those who flatter you may want something from you.",
    "United we stand, divided we fall.",
    "Look before you leap.",
]
says = ["said", "cried", "whispered", "laughed", "answered", "called out"]
lines_ = [
    "Good day to you, friend",
    "Why do you work so hard",
    "I shall have it all for myself",
    "Help me, and I will help you one day",
    "You are the finest creature in the land",
    "Wait for me",
    "There is enough for both of us",
    "I am not afraid of you",
]


def story():
    a, b = rng.sample(animals, 2)
    s = []
    s.append(f"{rng.choice(times)}, a {rng.choice(adjs)} {a} lived {rng.choice(places)}.")
    s.append(f"The {a} {rng.choice(verbs)} {rng.choice(things)} and was very pleased.")
    s.append(f"A {rng.choice(adjs)} {b} came by and saw it.")
    s.append(f'"{rng.choice(lines_)}," {rng.choice(says)} the {b}.')
    for _ in range(rng.randint(1, 3)):
        x = rng.choice([a, b])
        y = b if x == a else a
        s.append(
            rng.choice(
                [
                    f"The {x} thought for a while and then "
                    f"{rng.choice(verbs)} {rng.choice(things)}.",
                    f'"{rng.choice(lines_)}," {rng.choice(says)} the {x} to the {y}.',
                    f"So the {x} and the {y} walked {rng.choice(places)} until the sun went down.",
                    f"But the {x} did not listen, and soon it was too late.",
                    f"The {y} waited, counting {rng.randint(2, 12)} stars in the sky.",
                ]
            )
        )
    s.append(f"Moral: {rng.choice(morals)}")
    return " ".join(s)


train = [story() for _ in range(260)]
val = [story() for _ in range(24)]
for fname, stories in [("train.txt", train), ("validation.txt", val)]:
    with open(os.path.join(os.path.dirname(__file__), fname), "w") as f:
        f.write("\n".join(stories) + "\n")
