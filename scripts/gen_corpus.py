#!/usr/bin/env python3
"""Generates data/corpus.txt, the plain-text corpus of `tierzero train`'s
embedded default run.

The text is original: sentences are drawn from a small hand-written grammar
of old-fashioned English prose (a coastal village, its weather, its people
and their trades), so the corpus is free of anyone's copyright and needs no
download. It is deterministic (fixed seed): running this script again
reproduces the committed file byte for byte.

    python3 scripts/gen_corpus.py > data/corpus.txt
"""

import random
import sys

TARGET_BYTES = 200_000

PEOPLE = [
    "the old fisherman", "the miller's daughter", "the schoolmaster", "the parson",
    "the young sailor", "the widow Harlow", "the blacksmith", "the doctor",
    "a stranger from the north", "the shepherd", "the innkeeper", "my grandfather",
    "the lighthouse keeper", "the carpenter", "the girl who sold bread",
    "the captain", "the weaver", "the ferryman", "the poor clerk", "the squire",
]
NAMES = ["Thomas", "Margaret", "John", "Eliza", "William", "Anne", "Robert",
         "Mary", "Edward", "Catherine", "Samuel", "Jane", "Henry", "Ruth"]
PLACES = [
    "the harbour", "the market square", "the chapel on the hill", "the long beach",
    "the mill by the river", "the inn at the crossroads", "the high road",
    "the churchyard", "the cliffs", "the orchard", "the little school",
    "the quay", "the moor", "the old bridge", "the village green", "the forge",
]
TIMES = [
    "In the morning", "At dusk", "Before the sun was up", "Late that evening",
    "In the spring of that year", "When the winter came", "On the first day of May",
    "Towards the end of autumn", "At noon", "Long after midnight",
    "In those days", "Every Sunday", "On market day", "When the tide turned",
]
WEATHER = [
    "the wind came in cold from the sea", "a thin rain fell over the roofs",
    "the fog lay thick upon the water", "the sky was clear and pale",
    "the snow lay deep along the hedges", "the sun was warm upon the stones",
    "a great storm rose in the west", "the air was still and heavy",
    "the clouds hung low over the moor", "the frost had whitened every field",
]
VERBS_PAST = [
    "walked slowly down to", "hurried along to", "returned at last to",
    "went alone to", "set out for", "came back from", "stood waiting at",
    "looked for a long while at", "sat down near", "wandered about",
]
THINGS = [
    "a letter", "the boat", "a lantern", "the key of the church", "a basket of apples",
    "an old book", "the nets", "a loaf of bread", "a small wooden box", "the horse",
    "a candle", "the map", "a silver coin", "the bell rope", "a bundle of wool",
]
ADJ = ["quiet", "grey", "narrow", "ancient", "lonely", "bright", "crooked",
       "familiar", "silent", "broad", "weathered", "gentle", "dark", "humble"]
FEELINGS = [
    "a great weariness", "a sudden hope", "a quiet joy", "a deep unease",
    "an old sorrow", "a strange peace", "a kind of wonder", "some fear",
]
SAYINGS = [
    "The sea gives and the sea takes", "Bread is better than gold in a hard winter",
    "A kind word costs nothing and is worth a great deal",
    "He who waits for calm weather will never sail",
    "Mend the roof while the sun shines",
    "The longest road is the one you walk alone",
    "Every bell rings for someone", "Small fires warm the poor",
]
QUOTES = [
    "I shall not go back", "The boats are late tonight", "Come in out of the cold",
    "There is nothing more to be done", "We must wait for the tide",
    "Tell me what you saw", "It was not always so", "The road is long but we are young",
    "Keep the lamp burning", "I remember your father well",
]


def cap(s):
    return s[0].upper() + s[1:]


def sentence(r):
    k = r.randrange(12)
    p = r.choice(PEOPLE)
    if k == 0:
        return f"{r.choice(TIMES)}, {r.choice(WEATHER)}, and {p} {r.choice(VERBS_PAST)} {r.choice(PLACES)}."
    if k == 1:
        return f"{cap(p)} carried {r.choice(THINGS)} through the {r.choice(ADJ)} streets, and no one asked where it came from."
    if k == 2:
        return f"\"{r.choice(QUOTES)},\" said {r.choice(NAMES)}, and {r.choice(['turned away', 'smiled', 'said nothing more', 'looked at the fire', 'closed the door'])}."
    if k == 3:
        return f"There was in {r.choice(PLACES)} a {r.choice(ADJ)} house where {p} had lived for {r.choice(['many', 'forty', 'twenty', 'seven', 'eleven'])} years."
    if k == 4:
        return f"{cap(r.choice(NAMES))} felt {r.choice(FEELINGS)} as {r.choice(WEATHER)}."
    if k == 5:
        return f"As the old people used to say, \"{r.choice(SAYINGS)}.\""
    if k == 6:
        return f"{r.choice(TIMES)} {p} found {r.choice(THINGS)} lying in {r.choice(PLACES)}, and took it home."
    if k == 7:
        return f"The {r.choice(ADJ)} light of the evening fell upon {r.choice(PLACES)}, and {r.choice(WEATHER)}."
    if k == 8:
        return f"{cap(p)} and {r.choice(PEOPLE)} spoke together of {r.choice(['the harvest', 'the war', 'the price of bread', 'the ships that had not returned', 'the new road', 'old times'])} until the candles burned low."
    if k == 9:
        return f"Nobody in the village could remember a year when {r.choice(WEATHER)} for so long."
    if k == 10:
        return f"{cap(r.choice(NAMES))} had promised to bring {r.choice(THINGS)} to {r.choice(PLACES)}, but {r.choice(WEATHER)}, and the promise was kept only the next day."
    return f"It is said that {p} once {r.choice(VERBS_PAST)} {r.choice(PLACES)} with {r.choice(THINGS)} and came back {r.choice(['a changed man', 'with nothing', 'before dawn', 'laughing', 'in silence'])}."


def main():
    r = random.Random(20261129)
    out = []
    size = 0
    chapter = 1
    while size < TARGET_BYTES:
        if r.random() < 0.04 or not out:
            head = f"CHAPTER {chapter}\n\n"
            chapter += 1
            out.append(head)
            size += len(head)
        para = " ".join(sentence(r) for _ in range(r.randint(3, 7))) + "\n\n"
        out.append(para)
        size += len(para)
    sys.stdout.write("".join(out))


if __name__ == "__main__":
    main()
