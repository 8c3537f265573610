"""A phrasing grammar for the questions of `tiny`'s training rows and generalisation eval (issue 31).

The first trained `tiny` learned the generator's sentences, not its tasks: asked "Which line number of F holds
`class C`?" instead of "On which line of F is `class C` defined?", it called the wrong tool. Here every question
is drawn from a template of its intent (many verbs and word orders), with the slots (file, folder, pattern,
line number, entry) rendered in several forms (quoted or not), then decorated: context before the question,
politeness, casing, a dropped "?", and now and then one typo in a word that is not a slot.

Templates are split: those marked held out (``Template.heldout``) never appear in training rows; the eval asks
with them only (``question(rng, intent, slots, "heldout")``). The split is by template, written down below, the
same on every machine. Off-task messages (``off_task``) come from a grammar of their own, split the same way.
EXTRA training templates (``Template.extra``) and generated context sentences (``context_sentence``) join only
where asked for (``question(..., extra=True)``, tiny_general's focus rows), so other rows keep their questions.
LISTING templates (``Template.listing``) ask every list_dir intent in the words "the listing of D", "D's listing",
"the list of D" (``question(..., listing=True)``, tiny_general's listing drills); ``lure_sentence`` makes context
sentences whose words start like a path's parts.

    question(rng, intent, slots, split) -> (text, template id)
    off_task(rng, split) -> (text, template id)
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

SPLITS = ("train", "heldout")


@dataclass(frozen=True)
class Template:
    """One way to ask for ``intent``; ``text`` names its slots as ``{p}`` (file), ``{d}`` (folder), ``{n}`` (line
    number), ``{pat}`` (a grep pattern such as ``class Client``), ``{name}`` / ``{what}`` (its name and kind:
    ``Client``, ``class``), ``{x}`` (a folder entry); ``{nth}`` writes ``{n}`` as an ordinal ("14th", "22nd")."""

    intent: str
    text: str
    heldout: bool = False
    extra: bool = False  # training only, and only where asked for (``question(..., extra=True)``): see EXTRA
    listing: bool = False  # training only, drawn by ``question(..., listing=True)`` alone: see LISTING

    @property
    def id(self) -> str:
        return f"{self.intent}:{self.text}"


def _t(intent: str, train: list[str], heldout: list[str]) -> list[Template]:
    return [Template(intent, s) for s in train] + [Template(intent, s, True) for s in heldout]


def _x(intent: str, train: list[str]) -> list[Template]:
    return [Template(intent, s, extra=True) for s in train]


def _l(intent: str, train: list[str]) -> list[Template]:
    return [Template(intent, s, listing=True) for s in train]


# intent -> templates. The first train template of each intent is tiny_data's own (the in-template eval's) form.
_ALL: list[Template] = [
    *_t("first_def", [
        "What is the first function or class defined in {p}?",
        "Which function or class comes first in {p}?",
        "Name the first top-level def or class in {p}.",
        "What does {p} define first?",
        "In {p}, what is the first definition?",
        "Look at {p} and tell me the first function or class in it.",
        "Which def or class appears first in {p}?",
        "Tell me the name of the first class or function in {p}.",
        "{p}: what is defined first?",
        "Find the first definition in {p}.",
        "Which class or function does {p} start with?",
        "Show me the first def or class of {p}.",
        "I'd like to know the first function or class in {p}.",
        "Open {p}: what gets defined first?",
        "What's the very first function or class written in {p}?",
        "Tell me which definition comes first in {p}.",
        "Could you check {p} and name its first class or function?",
        "First def or class in {p}?",
        "Grep {p} for definitions: which one is first?",
        "Go through {p} and tell me what is defined at the top.",
        "The first function or class that {p} declares: what is it called?",
        "Name whatever class or function {p} opens with.",
        "Scan {p} for its first top-level definition.",
        "Starting from the top of {p}, which def or class do you hit first?",
    ], [
        "What's the earliest top-level definition you can find in {p}?",
        "Open {p} - which class or function is declared before all the others?",
    ]),
    *_t("line", [
        "What is on line {n} of {p}?",
        "Show me line {n} of {p}.",
        "What does line {n} of {p} say?",
        "Read line {n} of {p} for me.",
        "In {p}, what is line {n}?",
        "Print line {n} from {p}.",
        "{p}, line {n}: what is written there?",
        "Which code is at line {n} in {p}?",
        "Give me the text of line {n} in {p}.",
        "Can you quote line {n} of {p}?",
        "What is written on the {nth} line of {p}?",
        "Read the {nth} line of {p}.",
        "Show me the {nth} line in {p}.",
        "Quote the {nth} line of {p} for me.",
        "Open {p} at line {n} and tell me what is there.",
        "I need the content of line {n} in {p}.",
        "Line {n} of {p}, please.",
        "Which text does {p} have on line {n}?",
        "What's the {nth} line of {p}?",
        "Go to line {n} of {p}: what does it contain?",
        "Fetch line {n} from {p}.",
        "Look up line number {n} in {p}.",
        "Display the {nth} line from {p}.",
        "Check line {n} of {p} and read it out.",
    ], [
        "What sits on the {n}th line of {p}?",
        "Tell me exactly what {p} contains at line number {n}.",
    ]),
    *_t("def_line", [
        "On which line of {p} is `{pat}` defined?",
        "Where in {p} is `{pat}`? Give the line number.",
        "Find `{pat}` in {p}: which line?",
        "What line is `{pat}` on in {p}?",
        "In {p}, on what line is the {what} {name} defined?",
        "Give me the line number of `{pat}` in {p}.",
        "Search {p} for `{pat}` and tell me its line.",
        "At which line does {p} define the {what} `{name}`?",
        "Where is {what} {name} defined in {p}? I need the line.",
        "Line number of `{pat}` in {p}?",
        "Which line of {p} has `{pat}`?",
        "Tell me the line where `{pat}` appears in {p}.",
        "In {p}, where does the {what} {name} start? Line number, please.",
        "On what line of {p} can I find `{pat}`?",
        "Locate `{pat}` in {p} and give me its line.",
        "What is the line number of the {what} {name} in {p}?",
        "{p}: which line defines `{pat}`?",
        "Where does `{pat}` sit in {p}, line-wise?",
        "I want the line number where {p} declares `{pat}`.",
        "Grep {p} for `{pat}`; what line is it on?",
        "Look for the {what} {name} in {p}. Which line?",
        "Find the line of {p} that contains `{pat}`.",
        "At what line number is `{pat}` found in {p}?",
        "The {what} {name} in {p}: on which line is it defined?",
    ], [
        "Which line number of {p} holds `{pat}`?",
        "I'm looking for the definition of the {what} {name} inside {p}; what line does it start on?",
    ]),
    *_t("has", [
        "Is there a {x} in {d}?",
        "Does {d} contain {x}?",
        "Check whether {d} has {x}.",
        "Is {x} in {d}?",
        "Does {d} have an entry called {x}?",
        "Can you find {x} in {d}?",
        "Look in {d}: is {x} there?",
        "Tell me if {d} includes {x}.",
        "Does the folder {d} hold {x}?",
        "{d}: does it have {x}?",
        "Is {x} listed in {d}?",
        "Does {x} exist in {d}?",
        "Check if {x} is among the entries of {d}.",
        "List {d} and tell me whether {x} is there.",
        "Is there an entry named {x} in {d}?",
        "Can I find {x} inside {d}?",
        "Does the listing of {d} include {x}?",
        "Would {x} show up in {d}?",
        "Do we have {x} in {d}?",
        "I wonder if {d} contains an item called {x}.",
        "Among the entries of {d}, is there {x}?",
        "Look through {d} for {x}: present or not?",
        "Is something called {x} inside {d}?",
        "Search the listing of {d} for {x}.",
    ], [
        "Is {x} one of the entries of {d}?",
        "Would I find something named {x} if I listed {d}?",
    ]),
    *_t("first", [
        "What is the first entry of {d}?",
        "List {d}: which entry comes first?",
        "Which entry of {d} is listed first?",
        "What comes first when you list {d}?",
        "Give me the first item in {d}.",
        "List the folder {d} and tell me its first entry.",
        "In {d}, what is the first entry?",
        "What is at the top of the listing of {d}?",
        "Show the first name in {d}.",
        "{d}: first entry?",
        "Which entry appears first in {d}?",
        "What's the first thing listed in {d}?",
        "Tell me the first entry you get when you list {d}.",
        "List {d}. What is the first name?",
        "What item of {d} comes first?",
        "The listing of {d} starts with what?",
        "Give me the name at the top of {d}.",
        "What is listed first inside {d}?",
        "Show me what comes first in the listing of {d}.",
        "I need the first entry of {d}.",
        "Which name is at the head of {d}'s listing?",
        "What does a listing of {d} begin with?",
        "First item of {d}, please.",
        "Look at {d}: which entry is first?",
    ], [
        "Name the first item you see when listing {d}.",
        "If you list {d}, what shows up before everything else?",
    ]),
    *_t("count", [
        "How many entries are in {d}?",
        "Count the entries of {d}.",
        "How many items does {d} hold?",
        "What is the number of entries in {d}?",
        "Count what is in {d}.",
        "How many files and folders are in {d}?",
        "List {d} and count its entries.",
        "Tell me how many entries {d} has.",
        "How many things are in {d}?",
        "Count the items inside {d}.",
        "What's the number of entries that {d} has?",
        "How many names does a listing of {d} show?",
        "Give me the entry count of {d}.",
        "Tell me the number of files and folders in {d}.",
        "How many entries does {d} list?",
        "Count everything listed in {d}.",
        "How large is {d}: how many entries?",
        "I need the number of items in {d}.",
        "In total, how many entries are in {d}?",
        "How many elements does the folder {d} contain?",
        "List {d}: how many names do you see?",
        "Number of entries in {d}?",
        "How long is the listing of {d}, counted in entries?",
        "What is the size of {d}, in number of entries?",
        "How many entries, in total, does the listing of {d} show?",
        "If I list {d}, how many names come back?",
        "The folder {d}, how many entries does it have?",
        "Tell me the count of entries that a listing of {d} returns.",
    ], [
        "How big is the listing of {d}, in entries?",
        "What's the total count of things inside {d}?",
    ]),
    # multi-step: a folder is listed first, then a file found there is read or searched
    *_t("dir_first_def", [
        "What is the first function or class defined in the first Python file of {d}?",
        "Take the first .py file in {d}: what does it define first?",
        "List {d}, open its first Python file and tell me its first definition.",
        "Which def or class comes first in the first .py file of {d}?",
        "In {d}, find the first Python file; what is its first function or class?",
        "Open the first Python file listed in {d}: what is its first def or class?",
        "List {d}, take its first .py file and tell me what it defines first.",
        "Which function or class comes first in the first Python module of {d}?",
        "Find the first .py file in {d} and name its first definition.",
        "In the first Python file that {d} lists, what is defined first?",
        "Look in {d}, pick its first Python file, and tell me the first class or function in it.",
        "First Python file of {d}: which def or class does it start with?",
        "What does the first .py file of {d} define first?",
        "Whichever Python file {d} lists first, what does it define first?",
        "Of the Python files in {d}, take the first one listed: what is its first def or class?",
        "Go into {d}, pick the first .py file and name the first class or function it defines.",
        "{d} has some Python files; what is defined first in the first one?",
        "Whatever .py file comes first in {d}, which def or class does it open with?",
        "Check the listing of {d}, then tell me the first definition in its first Python file.",
        "Which class or function opens the first Python file that a listing of {d} shows?",
        "Before anything else, list {d}; then tell me what its first .py file defines first.",
    ], [
        "Among the Python files of {d}, pick the one listed first: which class or function does it start with?",
    ]),
    *_t("dir_line", [
        "What is on line {n} of the first Python file in {d}?",
        "Open the first .py file of {d} and show me line {n}.",
        "List {d}, then read line {n} of its first Python file.",
        "Line {n} of the first Python file in {d}: what is it?",
        "List {d} and show me line {n} of the first Python file in it.",
        "Read line {n} of whichever .py file comes first in {d}.",
        "Take the first Python file of {d}: what is its {nth} line?",
        "Find the first .py file in {d}, then tell me what is on line {n}.",
        "In the first Python module listed in {d}, what does line {n} contain?",
        "First .py file in {d}, line {n}: what does it say?",
        "Show the {nth} line of the first Python file that {d} lists.",
        "Open the first .py file of {d} at line {n}.",
        "Whichever .py file comes first in {d}, tell me its line {n}.",
        "Line {n} of whatever Python file is listed first in {d}: what is it?",
        "Take whichever Python file {d} shows first and read its line {n}.",
        "Go into {d}, find the first .py file there, and quote line {n} of it.",
        "{d} has some Python files; read line {n} of the first one.",
        "What does the first Python file under {d} say on its {nth} line?",
        "Check {d}: in the first .py file it lists, what is on line {n}?",
        "The first Python file of {d}: what does its line {n} say?",
        "Whatever .py file comes first in {d}: quote its line {n}.",
        "I need line {n} of the first .py file that the listing of {d} shows.",
        "Read the {nth} line of the Python file listed first in {d}.",
        "Which text is on line {n} of the first Python module in {d}? List the folder first.",
    ], [
        "Whatever Python file {d} lists first, what does its line {n} say?",
    ]),
]
# EXTRA: more training phrasings, drawn only by ``question(..., extra=True)`` (tiny_general's focus rows), so rows
# made without them stay byte for byte those of earlier runs. They aim at the held-out failures of the shipped
# weights: count questions answered as "the first entry" (and first-entry questions as "has"), and "the definition
# of the class X" grepped as ``def X`` (the word "definition" next to {what}). None is a held-out phrasing.
_ALL += [
    *_x("count", [
        "How big is {d}? Count its entries.",
        "How big is {d}, in number of entries?",
        "What's the total number of entries in {d}?",
        "Give me the total count of entries in {d}.",
        "What is the count of items inside {d}?",
        "How many things does {d} contain in total?",
        "Total entries in {d}?",
        "How large is the listing of {d}?",
        "Count up everything inside {d}.",
        "How many files and subfolders sit in {d}?",
        "What's the size of {d}, in items?",
        "Tally the entries of {d}.",
        "I'd like the number of things listed in {d}.",
        "How many names show up when you list {d}?",
        "How many entries come back if you list {d}?",
        "Could you count the contents of {d}?",
        "{d} holds how many entries?",
        "How many children does {d} have?",
        "Work out how many entries {d} has.",
        "What does the entry count of {d} come to?",
        "Find out how many items {d} contains.",
        "How full is {d}? Give me the number of entries.",
        "Listing {d}: how many entries in all?",
        "How many things are listed under {d}?",
        "What is the total of entries inside {d}?",
        "Count the things in {d} for me.",
        "How many entries make up {d}?",
        "Report the number of entries in {d}.",
        "Entries in {d}: how many?",
        "What's the number of things inside {d}?",
        "If you list {d}, how many entries do you get?",
        "How many items would a listing of {d} show?",
        "Size of {d}, counted in entries?",
        "Count {d}'s entries, please.",
    ]),
    *_x("first", [
        "When you list {d}, what comes up first?",
        "If I list {d}, which name is at the top?",
        "What shows up first in a listing of {d}?",
        "Which item do you see first when {d} is listed?",
        "Tell me the entry that appears before all others in {d}.",
        "What is the top entry of {d}?",
        "Which name does the listing of {d} open with?",
        "Read me the first name in {d}.",
        "List {d} and give me only the first entry.",
        "What is the very first thing inside {d}?",
        "The first name that a listing of {d} shows: what is it?",
        "Which entry of {d} sorts first?",
        "Of everything in {d}, which is listed first?",
        "What's at the head of the listing of {d}?",
        "Start listing {d}: what is the first entry you get?",
        "What entry leads the listing of {d}?",
        "Which file or folder is listed first in {d}?",
        "Just the first entry of {d}, please.",
        "If you list {d}, which entry do you see at the top?",
        "Name the entry at the top of {d}.",
    ]),
    *_x("has", [
        "If I listed {d}, would {x} be there?",
        "Is {x} among the things in {d}?",
        "Does a listing of {d} show {x}?",
        "Would {x} appear if you listed {d}?",
        "Is {x} present in {d}?",
        "Can {x} be found in {d}?",
        "Is there something called {x} in {d}?",
        "Does {d} include an entry named {x}?",
        "Is {x} part of {d}?",
        "Would listing {d} turn up {x}?",
        "{x}: is it in {d}?",
        "Check {d} for an entry named {x}.",
        "Tell me whether {x} is one of the items in {d}.",
        "Do you see {x} when you list {d}?",
        "Is {x} inside {d} or not?",
        "If you list {d}, is {x} among the names?",
    ]),
    *_x("def_line", [
        "Where is the definition of the {what} {name} in {p}? Give the line.",
        "Find the definition of {what} {name} in {p}: which line?",
        "In {p}, the {what} {name} is defined on which line?",
        "On which line does the definition of the {what} {name} begin in {p}?",
        "I need the line where {p} defines the {what} {name}.",
        "Which line of {p} starts the definition of {what} {name}?",
        "Line number of the definition of the {what} {name} in {p}?",
        "The definition of the {what} {name}: which line of {p} is it on?",
        "Search {p} for the definition of the {what} {name} and give its line number.",
        "Where does {p} define {what} {name}? Line number only.",
        "What line of {p} does the {what} {name} start on?",
        "Which line number in {p} has the {what} {name}?",
        "Give me the line number at which {p} defines `{pat}`.",
        "Line of `{pat}` inside {p}?",
        "At what line does `{pat}` start in {p}?",
        "Looking at {p}: which line number has the definition of {what} {name}?",
        "I'm after the definition of the {what} {name} in {p}. What is its line number?",
        "The {what} called {name}, defined in {p}: which line?",
    ]),
    *_x("line", [
        "What's written at line {n} of {p}?",
        "Tell me what line {n} of {p} holds.",
        "What does {p} contain on its {nth} line?",
        "Give me exactly the {nth} line of {p}.",
        "Read out what is at line number {n} in {p}.",
        "What text sits at line {n} in {p}?",
        "Quote line number {n} of {p} exactly.",
        "Which code does {p} have at line number {n}?",
    ]),
    *_x("first_def", [
        "Which definition comes earliest in {p}?",
        "What is declared first in {p}, class or function?",
        "Open {p} and name the first thing it defines.",
        "What's the first top-level class or function of {p}?",
        "Which class or function does {p} declare first?",
        "Tell me the earliest def or class in {p}.",
    ]),
]
# LISTING: count, first-entry and "contains" questions in the same words ("the listing of D", "D's listing", "the
# list of D"), drawn only by ``question(..., listing=True)`` (tiny_general's listing drills) together with every other
# training template in those words (LISTING_WORDS). In the other training phrasings "the listing of D" mostly asks
# for the first entry, and the shipped weights answered the held-out "How big is the listing of D, in entries?"
# with it. None is a held-out phrasing, nor within two words of one (a test measures the word distance).
_ALL += [
    *_l("count", [
        "Count the entries in the listing of {d}.",
        "What's the size of {d}'s listing?",
        "How many entries are in the listing of {d}?",
        "How many names does {d}'s listing hold?",
        "Count the names in {d}'s listing.",
        "What is the length of the listing of {d}?",
        "How many lines does the listing of {d} have?",
        "In the listing of {d}, how many entries are there?",
        "The listing of {d}: how many entries?",
        "Give me the number of entries in the list of {d}.",
        "How many items are on the list of {d}?",
        "How long is the list of entries in {d}?",
        "Count {d}'s listing for me.",
        "How many entries does {d}'s listing show?",
        "Tell me how many names the listing of {d} has.",
        "What's the entry count of the listing of {d}?",
        "Get the listing of {d} and count it.",
        "How many entries make up the listing of {d}?",
        "Number of names in {d}'s listing?",
        "What does the listing of {d} add up to, in entries?",
    ]),
    *_l("first", [
        "What is the first name in the listing of {d}?",
        "Which entry heads {d}'s listing?",
        "What's the first line of the listing of {d}?",
        "Give me the first entry in the listing of {d}.",
        "In the listing of {d}, which entry comes first?",
        "The listing of {d}: what is its first entry?",
        "What does {d}'s listing start with?",
        "What's first on the list of {d}?",
        "Tell me the first entry of {d}'s listing.",
        "Which entry is at the top of the list of {d}?",
        "What's the first item in the listing of {d}?",
        "Get the listing of {d} and tell me its first entry.",
        "First name in the listing of {d}?",
        "Which name comes first in {d}'s listing?",
    ]),
    *_l("has", [
        "Is {x} in the listing of {d}?",
        "Does {d}'s listing have {x} in it?",
        "Does the listing of {d} contain {x}?",
        "Is {x} on the list of {d}?",
        "Would the listing of {d} show {x}?",
        "In the listing of {d}, is there {x}?",
        "Check the listing of {d} for {x}.",
        "The listing of {d}: does it include {x}?",
        "Is {x} anywhere in {d}'s listing?",
        "Does {x} appear in the list of {d}?",
        "Get the listing of {d} and tell me if {x} is in it.",
        "Can you see {x} in {d}'s listing?",
    ]),
]
LISTING_WORDS = re.compile(r"\blisting\b|\blist of\b|'s list\b", re.IGNORECASE)
TEMPLATES: dict[str, list[Template]] = {
    i: [t for t in _ALL if t.intent == i] for i in dict.fromkeys(t.intent for t in _ALL)
}
INTENTS = tuple(TEMPLATES)
SLOTS = {
    "first_def": {"p"}, "line": {"n", "p"}, "def_line": {"p", "pat", "what", "name"}, "has": {"d", "x"},
    "first": {"d"}, "count": {"d"}, "dir_first_def": {"d"}, "dir_line": {"d", "n"},
}

CONTEXT = {
    "train": [
        "I'm debugging a failing import.", "We are reviewing this package before a release.",
        "I'm new to this code base.", "My tests broke after an upgrade.", "Quick check before I commit.",
        "I am writing the docs for this project.", "A colleague pointed me here.",
        "I'm trying to understand how this module is organised.", "Context: we are refactoring.",
    ],
    "heldout": ["I have a code review in ten minutes.", "Our CI is red and I'm hunting the cause."],
}
BEFORE = ["Please, ", "Hey, ", "Quick question: ", "Could you tell me: ", "I need to know: ", "Hi! "]
AFTER = [" Thanks!", " Thank you.", " Please.", " Thanks in advance.", " Cheers."]

_SLOT_RE = re.compile(r"\{(\w+)\}")
_WORD_RE = re.compile(r"[A-Za-z]{4,}")


def _quoted(rng: random.Random, s: str) -> str:
    """A file or entry name as people write it: bare mostly, else in backticks or quotes."""
    return rng.choices([s, f"`{s}`", f'"{s}"', f"'{s}'"], (5, 2, 1, 1))[0]


def _folder(rng: random.Random, d: str) -> str:
    """A folder slot: ``the project root`` for ".", else with or without its slash, quoted, or as "the X folder"."""
    if d in (".", ""):
        return rng.choice(["the project root", "the root folder", "the top-level folder"])
    k = rng.random()
    if k < 0.45:
        return f"{d}/"
    if k < 0.6:
        return d
    if k < 0.8:
        return _quoted(rng, f"{d}/")
    return f"the {d} folder" if rng.random() < 0.5 else f"the {d}/ directory"


def ordinal(n: str) -> str:
    """``n`` as an ordinal: 1st, 2nd, 3rd, 4th, 11th, 12th, 13th, 21st, 22nd, ..."""
    k = int(n)
    suffix = "th" if 10 <= k % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(k % 10, "th")
    return f"{k}{suffix}"


def _typo(rng: random.Random, word: str) -> str:
    """One slip of the keyboard in ``word``: two letters swapped, one dropped or one doubled."""
    i = rng.randrange(1, len(word) - 1)
    k = rng.randrange(3)
    if k == 0:
        return word[:i] + word[i + 1] + word[i] + word[i + 2:]
    if k == 1:
        return word[:i] + word[i + 1:]
    return word[:i] + word[i] + word[i:]


def _literal(rng: random.Random, text: str, typo: bool) -> str:
    """The template's own words (never a slot) with, if ``typo``, one word of 4+ letters mistyped."""
    words = list(_WORD_RE.finditer(text)) if typo else []
    if not words:
        return text
    m = rng.choice(words)
    return text[: m.start()] + _typo(rng, m.group()) + text[m.end():]


def templates(intent: str, split: str, extra: bool = False, listing: bool = False) -> list[Template]:
    """The templates of ``intent`` in ``split``; ``extra``: with the EXTRA training ones too; ``listing``: only
    the training ones in LISTING_WORDS, the LISTING ones among them."""
    if intent not in TEMPLATES:
        raise ValueError(f"intent must be one of {INTENTS}, got {intent!r}")
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if listing:
        if split != "train":
            raise ValueError("listing phrasings are for training questions only")
        return [t for t in TEMPLATES[intent] if not t.heldout and LISTING_WORDS.search(t.text)]
    return [t for t in TEMPLATES[intent] if t.heldout == (split == "heldout") and (extra or not t.extra)
            and not t.listing]


def template_regex(t: Template | str) -> re.Pattern[str]:
    """A regex that finds the template in a question whatever its slots, case and final punctuation (not through
    a typo): how tests check that no training question uses a held-out phrasing."""
    text = (t.text if isinstance(t, Template) else t).rstrip("?.!")
    parts = _SLOT_RE.split(text)
    body = "".join(re.escape(p) if i % 2 == 0 else ".+?" for i, p in enumerate(parts))
    return re.compile(body, re.IGNORECASE | re.DOTALL)


def render_slots(rng: random.Random, template: Template, slots: dict[str, str], typo: float = 0.0) -> str:
    """The template with its slots filled: files and entries maybe quoted, folders in one of their forms,
    patterns always in backticks where the template puts them. A typo touches the template's words only."""
    parts = _SLOT_RE.split(template.text)  # literal, slot, literal, slot, ...
    out = []
    for i, part in enumerate(parts):
        if i % 2 == 0:
            out.append(_literal(rng, part, typo > 0 and rng.random() < typo))
        elif part == "d":
            out.append(_folder(rng, slots["d"]))
        elif part in ("p", "x"):
            out.append(_quoted(rng, slots[part]))
        elif part == "nth":
            out.append(ordinal(slots["n"]))
        else:
            out.append(str(slots[part]))
    return "".join(out)


def decorate(rng: random.Random, text: str, split: str) -> str:
    """Context before the question, politeness, casing and punctuation, each now and then."""
    if rng.random() < 0.25:
        text = (rng.choice(BEFORE) + text[0].lower() + text[1:]) if text[0].isalpha() else rng.choice(BEFORE) + text
    if rng.random() < 0.1 and text[0].isupper() and not text.split(" ", 1)[0].isupper():
        text = text[0].lower() + text[1:]
    if rng.random() < 0.15 and text.endswith("?"):
        text = text[:-1]
    if rng.random() < 0.2:
        text += rng.choice(AFTER)
    if rng.random() < 0.25:
        text = rng.choice(CONTEXT[split]) + rng.choice([" ", "\n"]) + text
    return text


def question(
    rng: random.Random, intent: str, slots: dict[str, str], split: str, typo: float = 0.1, plain: bool = False,
    extra: bool = False, words: tuple[str, ...] = (), listing: bool = False, lure: str = "",
) -> tuple[str, str]:
    """(question text, template id) asking for ``intent`` about ``slots`` in a phrasing of ``split``; ``plain``:
    the template with its slots only (no quotes, context, politeness or typos). ``extra`` (training only): the
    EXTRA templates join the draw, and the context before a question is a ``context_sentence`` half the time,
    naming some of ``words`` (at False nothing more is drawn: the questions of earlier runs). ``listing``
    (training only): the template is one in LISTING_WORDS (``templates(..., listing=True)``). ``lure`` (with
    ``extra``): a sentence (``lure_sentence``) said before the question, or now and then after it, instead of a
    ``context_sentence``."""
    if (extra or listing) and split != "train":
        raise ValueError("extra phrasings are for training questions only")
    t = rng.choice(templates(intent, split, extra, listing))
    if missing := SLOTS[intent] - set(slots):
        raise ValueError(f"intent {intent!r} needs slots {sorted(SLOTS[intent])}, missing {sorted(missing)}")
    if plain:
        return t.text.format(**slots, **({"nth": ordinal(slots["n"])} if "n" in slots else {})), t.id
    text = decorate(rng, render_slots(rng, t, slots, typo), split)
    if extra and lure:
        text = lure + rng.choice([" ", " ", "\n"]) + text if rng.random() < LURE_BEFORE else f"{text} {lure}"
    elif extra and rng.random() < 0.5:
        text = context_sentence(rng, words) + rng.choice([" ", " ", "\n"]) + text
    return text, t.id


# ---- context sentences of the focus rows: many, with words that look like names -------------------------------

_CTX_EVENTS = ("demo", "standup", "release", "planning meeting", "deploy window", "call with a customer",
               "pairing session", "design review", "retro", "handover", "lunch break", "train to catch")
_CTX_TIMES = ("two minutes", "five minutes", "twenty minutes", "half an hour", "an hour", "fifteen minutes",
              "three hours", "45 minutes", "90 seconds", "the afternoon")
_CTX_SYSTEMS = ("build", "pipeline", "nightly job", "staging deploy", "test suite", "linter", "release branch",
                "docker image", "smoke test", "benchmark")
_CTX_STATES = ("broken", "failing", "flaky", "slow", "stuck", "timing out", "green again", "acting up")
_CTX_DOING = ("trying to find out why", "looking into it", "chasing a regression", "reading the code",
              "bisecting it", "writing a fix", "collecting facts", "tracing the problem")
_CTX_PEOPLE = ("My manager", "A colleague", "The reviewer", "Our tech lead", "A user", "The release manager",
               "Someone on the team", "My mentor")
_CTX_ASKS = ("asked me to check this", "wants an answer today", "pointed me to this package",
             "reported a bug here", "asked about this module", "needs this for the changelog")
_CTX_WITH_WORD = (
    "The ticket mentions {w}, but that may be a red herring.", "Last week we renamed {w} and {w2}.",
    "I already looked at {w}; nothing there.", "Ignore {w} for now.", "Version {num} broke something around {w}.",
    "We talked about {w} and {w2} in the meeting.", "My notes say {w}, which is probably wrong.",
    "Not {w}: something else.", "Earlier I was reading about {w}.", "The {w} team owns part of this.",
    "I spent {num} minutes on {w} already.", "{W} is what the logs complain about.",
)


def context_sentence(rng: random.Random, words: tuple[str, ...] = ()) -> str:
    """A sentence of context before a training question, from a grammar of its own (thousands of sentences: the
    two held-out ones are never made); with ``words``, half of them name one or two of those words (names of the
    project, say), which a call must not copy: the question's own path is what it names."""
    k = rng.random()
    if words and k < 0.5:
        w, w2 = rng.choice(words), rng.choice(words)
        text = rng.choice(_CTX_WITH_WORD).format(w=w, w2=w2, W=w[:1].upper() + w[1:], num=rng.randrange(2, 200))
    elif k < 0.62:
        text = f"I have a {rng.choice(_CTX_EVENTS)} in {rng.choice(_CTX_TIMES)}."
    elif k < 0.77:
        text = f"Our {rng.choice(_CTX_SYSTEMS)} is {rng.choice(_CTX_STATES)} and I'm {rng.choice(_CTX_DOING)}."
    elif k < 0.9:
        text = f"{rng.choice(_CTX_PEOPLE)} {rng.choice(_CTX_ASKS)}."
    else:
        text = rng.choice(CONTEXT["train"])
    return text if text not in CONTEXT["heldout"] else rng.choice(CONTEXT["train"])


# ---- lure sentences: context whose words start like the parts of the path the call must name ---------------------

LURE_BEFORE = 0.75  # of lure sentences said before the question (else after it)
_LURE_MENTION = (
    "The ticket mentions {w}, but that may be a red herring.", "Someone wrote '{w}' in the chat; ignore that.",
    "Keywords from the bug report: {w}, {w2}.", "I already searched for {w} and {w2}.",
    "The commit message just says '{w}'.", "Not to be confused with {w}.", "Autocomplete keeps suggesting {w} here.",
    "The error log mentions {w} twice.", "Our wiki page on {w} is out of date.", "Last sprint was all about {w}.",
    "My notes say {w}, probably wrong.", "{W} and {w2} came up in the review.", "I typed {w} by mistake before.",
    "Search results for {w} were useless.", "The word {w} keeps coming up in the logs.",
)
_LURE_NATURAL = (
    "I have to {act} in {time}.", "I need to {act} in {time}, so keep it short.",
    "Please be quick: I have to {act} in {time}.", "I'll {act} after this, in {time} or so.",
    "No rush, I'll {act} in {time} anyway.", "Tell me quickly, I have to {act}.", "In {time} I have to {act}.",
    "Once this is answered I'll {act}.", "I can only look at this for {time}.", "Then I {must} {act}.",
)
LURE_FRAMES = _LURE_MENTION + _LURE_NATURAL  # every lure sentence is one of these with its slots filled
_LURE_MUST = ("must", "should", "have to", "need to", "want to", "plan to", "promised to")
_LURE_ACTS = (
    "look at it again", "tell my team", "take a break", "test the fix", "talk to the reviewer", "leave for lunch",
    "log off", "lock my screen", "push the branch", "pull the latest code", "print the report", "pick this up again",
    "send a summary", "start the deploy", "stop the server", "show it to the team", "run the tests", "read the docs",
    "return to it", "write the notes", "walk the dog", "wait for the build", "watch the pipeline", "merge the branch",
    "move on", "meet a client", "fix the release", "file a ticket", "finish the review", "follow up", "help a colleague",
    "hand it over", "build the image", "bring coffee", "grab lunch", "go home", "debug another thing",
    "deploy the service", "update the docs", "open a pull request", "order food", "ask the lead", "add a test",
    "check the logs", "change the config", "close the ticket", "clean up", "commit my work", "call the vendor",
    "present the results", "plan the sprint", "prepare slides", "profile the server", "join a call",
    "review another patch", "rebase the branch", "reply to email", "sign off", "ship the release",
    "sync with the team", "upgrade my laptop", "vote on the design", "keep going", "kick off a build",
    "zip the logs", "queue another job", "explain it to my boss", "export the data", "note it down",
    "answer mail", "archive the thread", "book a room", "benchmark the change", "catch a train", "drive home",
    "email the client", "gather the numbers", "install the update", "label the issues", "measure the latency",
    "nudge the reviewer", "onboard a new hire", "pair with a colleague", "restart the worker", "summarize this",
    "triage new bugs", "unblock a teammate", "verify the build", "wrap up", "yield the room",
)
_LURE_TIMES = (  # not "ten minutes": the held-out context sentence's words
    "two minutes", "twelve minutes", "three hours", "thirty seconds", "twenty minutes", "four days",
    "five minutes", "fifteen minutes", "six hours", "seven days", "eight minutes", "nine hours", "eleven minutes",
    "a long while", "a little while", "a moment", "a minute", "an hour", "half an hour", "a few hours",
    "a couple of days", "the morning", "the evening", "the afternoon", "one hour", "some time",
    "a week", "a month", "a second", "the next sprint", "the new year", "a quick break", "forty minutes",
    "ninety seconds", "sixty seconds", "an instant", "the weekend", "the holidays", "the upcoming release",
)


def lures_in(text: str, stems: list[str] | tuple[str, ...]) -> list[tuple[str, str]]:
    """(word, stem) for each word of ``text`` (3+ letters, any case) that starts with the same 2-4 letters as one
    of ``stems`` (lower-case letters) and is not that stem: the words a bad copy of the stem may drift to."""
    out = []
    for w in re.findall(r"[A-Za-z]{3,}", text):
        low = w.lower()
        out += [(w, s) for s in stems if low != s and low[:2] == s[:2]]
    return out


def lure_sentence(rng: random.Random, stems: list[str], words: list[str]) -> str:
    """A context sentence whose words start like ``stems`` (the letters the parts of a path start with): half the
    time a natural one ("I have to look at it again in a long while." for ``loops/``), built from phrases that
    share a stem's first letters where any do, else one that mentions ``words`` (plain words chosen by the caller
    to start like a stem). Always holds a lure (``lures_in``); never three words in a row of a held-out context
    sentence."""
    if rng.random() < 0.5:
        acts = [a for a in _LURE_ACTS if lures_in(a, stems)] or list(_LURE_ACTS)
        times = [t for t in _LURE_TIMES if lures_in(t, stems)] or list(_LURE_TIMES)
        text = rng.choice(_LURE_NATURAL).format(act=rng.choice(acts), time=rng.choice(times), must=rng.choice(_LURE_MUST))
        if lures_in(text, stems) and text not in CONTEXT["heldout"]:
            return text
    w, w2 = rng.sample(words, 2) if len(words) > 1 else (words[0], words[0])
    return rng.choice(_LURE_MENTION).format(w=w, w2=w2, W=w[:1].upper() + w[1:])


# ---- off-task messages: answered by a fixed refusal that says what the model can do ----------------------------

OFF_TASK = {
    "train": [
        "Hello, who are you?", "Hi!", "Good morning.", "How are you today?", "What can you do?", "Tell me a joke.",
        "Write me a poem about {topic}.", "What is the capital of {country}?", "What is {a} times {b}?",
        "What's the weather like in {city}?", "Translate 'good morning' into {language}.",
        "Book a flight to {city} for tomorrow.", "Who won the football world cup in {year}?",
        "Summarise the news of today.", "Write a short story about {topic}.", "Can you recommend a film?",
        "What time is it in {city}?", "Send an email to my manager saying I'm late.",
        "Explain quantum physics in simple terms.", "What should I cook tonight?", "Who are you, really?",
        "Sing me a song about {topic}.", "How tall is Mount Everest?", "Give me three facts about {country}.",
        "What is the meaning of life?", "Thanks, that's all.", "Write a cover letter for me.",
        "How do I get to {city} by train?", "Play some music.", "What's {a} plus {b}?",
        "How many inhabitants does {city} have?", "What is the population of {country}?",
        "How many people speak {language}?", "How many tourists visit {city} every year?",
        "How many cities are there in {country}?", "Roughly how many people live on Earth?",
        # more of the same families in other words: questions about the world (many start "how many"), sums,
        # reminders and alarms, errands, trivia, writing, greetings; none names a file or folder of the project
        "How many moons does {planet} have?", "How many legs does a {animal} have?", "How many days are in {month}?",
        "How many languages are spoken in {country}?", "How many players are on a {sport} team?",
        "How many hours of sleep do I need?", "How many calories are in an {fruit}?",
        "How many kilometres is it from {city} to {city2}?", "How old is the universe?",
        "What is {a} minus {b}?", "Multiply {a} by {b}.", "Divide {a} by {b}.", "Calculate {a} + {b} for me.",
        "What's the square root of {a}?", "Is {a} a prime number?", "Convert {a} miles to kilometres.",
        "Remind me to call my mother at {a} o'clock.", "Wake me up in {a} minutes.", "Set an alarm for {a}:30.",
        "Start a stopwatch.", "Add milk to my shopping list.", "Schedule a meeting with {name} on Friday.",
        "Call {name}.", "Text {name} that I'm on my way.", "Order a taxi to the airport.", "Buy me a new phone.",
        "Reserve a table for two in {city}.", "Turn off the lights in the kitchen.",
        "Who wrote {book}?", "Who invented the telephone?", "When did the {event} happen?",
        "Which is the largest ocean?", "Who was the first person on the moon?", "What is the population of {city}?",
        "Where is {city}?", "Why is the sky blue?", "What language do people speak in {country}?",
        "Write a limerick about {topic}.", "Compose a sonnet about {topic}.", "Draft a speech for a wedding.",
        "Give me a riddle.", "Describe {topic} in three words.", "Make up a name for my dog.",
        "Good evening!", "Hey there, what should I call you?", "Nice to meet you.", "Are you a robot?",
        "How old are you?", "Do you have feelings?", "Goodbye!", "What's new?",
        "Should I learn the piano or the guitar?", "How can I sleep better?", "Recommend a book about {topic}.",
        "What's a good name for a bakery?", "Plan a trip to {country} for me.", "Help me write a birthday card.",
        # programming in general, not this project's files
        "Write a Python function that sorts a list.", "Explain what a decorator is.", "How do I install numpy?",
        "What is the difference between a list and a tuple?", "Fix my code: it crashes.", "Which is faster, C or Python?",
    ],
    "heldout": [
        "Hello there! What's your name?", "Can you order me a pizza?", "Compose a haiku about {topic}.",
        "How many people live in {country}?", "What's {a} divided by {b}?", "Set a timer for {a} minutes.",
        "Who painted the Mona Lisa?", "Tell me something interesting about {city}.",
    ],
}
_FILL = {
    "topic": ["the sea", "autumn", "a cat", "the mountains", "coffee", "rain", "a lighthouse", "friendship"],
    "country": ["France", "Japan", "Brazil", "Kenya", "Canada", "Norway", "India", "Chile"],
    "city": ["Paris", "Tokyo", "Lagos", "Lima", "Oslo", "Denver", "Madrid", "Seoul"],
    "language": ["German", "Spanish", "Japanese", "Italian", "Swahili"],
}
# slots of the training messages only (drawn after _FILL's, and for training only, so held-out draws are unchanged)
_FILL_TRAIN = {
    "planet": ["Mars", "Jupiter", "Saturn", "Neptune", "Uranus"],
    "animal": ["spider", "dog", "bird", "horse", "crab", "beetle"],
    "month": ["February", "March", "June", "September", "December"],
    "sport": ["football", "basketball", "volleyball", "rugby", "hockey", "cricket"],
    "fruit": ["apple", "orange", "avocado", "egg", "onion"],
    "city2": ["Berlin", "Rome", "Cairo", "Boston", "Sydney", "Nairobi", "Quito"],
    "name": ["Anna", "my boss", "Mum", "Carlos", "Priya", "the dentist"],
    "book": ["Hamlet", "Don Quixote", "War and Peace", "Pride and Prejudice", "the Odyssey"],
    "event": ["French Revolution", "moon landing", "fall of the Berlin Wall", "first Olympic Games"],
}
REFUSAL = (
    "I can only answer questions about the files of this project: I list folders, read files and search them "
    "with grep, then answer from what the tools show."
)


def off_task(rng: random.Random, split: str) -> tuple[str, str]:
    """(an off-task message of ``split``'s templates, its template id), lightly decorated."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    t = rng.choice(OFF_TASK[split])
    fill = {k: rng.choice(v) for k, v in _FILL.items()} | {
        "a": str(rng.randrange(2, 100)), "b": str(rng.randrange(2, 100)), "year": str(rng.randrange(1950, 2023)),
    }
    if split == "train":
        fill |= {k: rng.choice(v) for k, v in _FILL_TRAIN.items()}
    text = t.format(**fill)
    if rng.random() < 0.15:
        text = rng.choice(BEFORE) + text[0].lower() + text[1:]
    if split == "train" and rng.random() < 0.15:  # a project's context does not make the message a project task
        text = rng.choice(CONTEXT["train"]) + rng.choice([" ", "\n"]) + text
    return text, f"off_task:{t}"
