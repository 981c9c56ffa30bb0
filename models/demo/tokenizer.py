"""Deterministic demo tokenizer in Gemma 4 form, as GGUF `tokenizer.*` metadata.

A BPE vocabulary is trained with the `tokenizers` library on built-in English-ish text (plus a little
code and accented text), then laid out like Gemma 4's: control tokens at fixed ids (pad 0, eos 1,
bos 2, unk 3, ...), the 256 byte-fallback tokens `<0x00>`..`<0xFF>`, then the learned pieces.
Spaces are `▁`; training splits words (with their leading `▁` run) so the learned merges look like a
sentencepiece vocabulary, while encoding (engine/text/tokenizer.py) pre-splits only on `[^\\n]+|[\\n]+`.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

# GGUF token types (gguf.constants.TokenType)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# ids 0..len-1, in this order. 0-3 are fixed by the contract; the rest follow Gemma 4's names.
CONTROL_TOKENS: tuple[str, ...] = (
    "<pad>", "<eos>", "<bos>", "<unk>", "<mask>",
    "<|turn>", "<turn|>", "<|channel>", "<channel|>",
    "<|tool_call>", "<tool_call|>", "<|tool_response>", "<tool_response|>",
    '<|"|>', "<|think|>", "<|tool>", "<tool|>",
    "<|image|>", "<|audio|>", "<|video|>",
)
VOCAB_SIZE_TARGET = 3072
TEMPLATE_PATH = Path(__file__).with_name("chat_template.jinja")

_PASSAGE = """\
The quick brown fox jumps over the lazy dog. A small model can still learn the shape of a language:
which letters follow which, where words end, and how sentences are built from clauses.
When the server receives a request, it turns the messages into a prompt, splits the prompt into
tokens, and looks for the longest prefix it has already computed. The cache keeps the keys and values
of earlier requests, so a follow-up question only pays for the new tokens at the end of the chat.
Sliding window layers only need the last few thousand positions, while full attention layers need all
of them. That is why the cache stores two kinds of pages and evicts them on different schedules.

Hello! How are you today? I'm fine, thank you. Could you tell me the weather in Paris, please?
It is sunny and warm, about 24 degrees, with a light wind from the west. Tomorrow it may rain.
Write a short poem about the sea. The sea is wide and grey and deep; it sings the sailors all to sleep.
What is 12 plus 30? The answer is 42. What is the capital of Japan? Tokyo is the capital of Japan.
Summarize the following text in one sentence. The report says that sales grew by 7% in 2024.
Please translate "good morning" into French: bonjour. The café served a crème brûlée to the naïve
visitor from Zürich; the résumé listed São Paulo, Kraków and Málaga as previous homes.

def fibonacci(n: int) -> list[int]:
    values = [0, 1]
    while len(values) < n:
        values.append(values[-1] + values[-2])
    return values[:n]

for i in range(10):
    if i % 2 == 0:
        print(f"even {i}")
    else:
        print("odd", i)

{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
SELECT id, name FROM users WHERE age > 30 ORDER BY name;
https://example.com/path/to/page?query=value&other=1
"""

_SUBJECTS = (
    "the model", "a student", "the engineer", "our team", "the old library", "every request",
    "the small cat", "this function", "the river", "a new paper", "the scheduler", "my friend",
    "the teacher", "the server", "each layer", "the garden", "a careful reader", "the city council",
)
_VERBS = (
    "reads", "writes", "computes", "finds", "keeps", "returns", "explains", "builds", "measures",
    "describes", "remembers", "answers", "changes", "improves", "follows", "shares", "checks",
    "opens", "closes", "counts", "moves", "learns", "teaches", "tests", "sends", "receives",
)
_OBJECTS = (
    "the answer", "a long document", "three tokens", "the first page", "a simple example",
    "the results", "an important question", "the weather report", "a cup of coffee", "the memory",
    "every value", "the final number", "a quiet evening", "the main idea", "two small boxes",
    "the whole story", "a clear message", "the next step", "some useful data", "the open window",
)
_TAILS = (
    "before the meeting", "after a short break", "with great care", "in the morning",
    "without any errors", "for the first time", "at the end of the day", "during the test",
    "because it is useful", "while the music plays", "as fast as possible", "on a rainy day",
    "in the small kitchen", "near the station", "under the bright lights", "every single week",
)
_WORDS = """
about above across act action add address after again against age ago agree air all allow almost alone along
already also always among amount analysis animal another answer any anyone anything appear apply approach area
argue arm around arrive art article artist ask attack attention audience author authority available avoid away
baby back bad bag ball bank bar base beat beautiful because become bed before begin behavior behind believe
benefit best better between beyond big bill billion bit black blood blue board body book born both box boy
break bring brother budget build building business buy call camera campaign cancer candidate capital car card
care career carry case catch cause cell center central century certain chair challenge chance change character
charge check child choice choose church citizen city civil claim class clear close coach cold collection
college color come commercial common community company compare computer concern condition conference
consider consumer contain continue control cost could country couple course court cover create crime
cultural culture current customer cut dark data daughter dead deal death debate decade decide decision deep
defense degree democratic describe design despite detail determine develop difference different difficult
dinner direction director discover discuss disease doctor door down draw dream drive drop drug during each
early east easy economic economy edge education effect effort eight either election else employee energy
enjoy enough enter entire environment environmental especially establish even evening event ever every
everybody everyone everything evidence exactly example executive exist expect experience expert explain eye
face fact factor fail fall family far fast father fear federal feel feeling few field fight figure fill film
final finally financial find fine finger finish fire firm first fish five floor fly focus follow food foot
force foreign forget form former forward four free friend from front full fund future game garden gas
general generation girl give glass goal good government great green ground group grow growth guess gun guy
hair half hand hang happen happy hard have head health hear heart heat heavy help here herself high himself
history hold home hope hospital hot hotel hour house however huge human hundred husband idea identify image
imagine impact important improve include including increase indeed indicate individual industry information
inside instead institution interest interesting international interview investment involve issue item itself
join just keep kid kill kind kitchen know knowledge land language large last late later laugh law lawyer lay
lead leader learn least leave left legal less letter level life light like likely line list listen little
live local long look lose loss love machine magazine main maintain major majority make manage management
manager many market marriage material matter maybe mean measure media medical meet meeting member memory
mention message method middle might military million mind minute miss mission model modern moment money
month more morning most mother mouth move movement movie much music must myself name nation national natural
nature near nearly necessary need network never news newspaper next nice night none nor north note nothing
notice number occur offer office officer official often once only onto open operation opportunity option
order organization other others outside over own owner page pain painting paper parent part participant
particular particularly partner party pass past patient pattern peace people perform performance perhaps
period person personal phone physical pick picture piece place plan plant play player point police policy
political politics poor popular population position positive possible power practice prepare present
president pressure pretty prevent price private probably problem process produce product production
professional professor program project property protect prove provide public pull purpose push quality
quickly quite race radio raise range rate rather reach ready real reality realize really reason recent
recently recognize record reduce reflect region relate relationship religious remain remove report represent
require research resource respond response responsibility rest result return reveal rich right rise risk road
rock role room rule safe same save scene school science scientist score season seat second section security
seek seem sell senior sense series serious serve service seven several shake share shoot short shot should
shoulder show side sign significant similar simple simply since sing single sister site situation size skill
skin smile social society soldier someone something sometimes song soon sort sound source south southern
space speak special specific speech spend sport spring staff stage stand standard star start state statement
station stay still stock stop store strategy street strong structure student study stuff style subject
success successful such suddenly suffer suggest summer support sure surface system table take talk task tax
teach teacher technology television tell tend term terms than thank their them themselves theory there these
they thing think third those though thought three through throughout throw thus time today together tonight
total tough toward town trade traditional training travel treat treatment tree trial trip trouble true truth
turn type under understand unit until upon usually value various very victim view violence visit voice vote
wait walk wall want watch water weapon wear week weight well west western what whatever when where whether
which while white whole whom whose wide wife will wind window wish with within without woman wonder word
work worker world worry would write writer wrong yard yeah year young yourself
""".split()
_OPENERS = ("", "", "", "Today ", "However, ", "Then ", "Yesterday ", "Sometimes ", "Finally, ")
_ENDS = (".", ".", ".", "!", "?", ";")


def _corpus() -> list[str]:
    """The training text: the passage plus sentences from a fixed linear congruential generator."""
    state = 12345

    def pick(seq: tuple[str, ...] | list[str]) -> str:
        nonlocal state
        state = (state * 1103515245 + 12345) % (1 << 31)
        return seq[(state >> 8) % len(seq)]

    lines = _PASSAGE.split("\n")
    for n in range(900):
        opener = pick(_OPENERS)
        subject = pick(_SUBJECTS)
        if not opener:
            subject = subject[0].upper() + subject[1:]
        line = f"{opener}{subject} {pick(_VERBS)} {pick(_OBJECTS)} {pick(_TAILS)}{pick(_ENDS)}"
        if n % 7 == 0:
            line += f" It took {n % 97} minutes and {n * 13 % 1000} steps."
        if n % 11 == 0:
            line = "    " + line
        lines.append(line)
    for n in range(400):
        k = 6 + n % 9
        words = [pick(_WORDS) for _ in range(k)]
        lines.append(" ".join(words).capitalize() + pick(_ENDS))
    for w in _WORDS:
        lines.append(f"{w} {w.capitalize()} {w}s {w}ed {w}ing")
    for _ in range(60):  # chat-shaped text: role names right after a newline
        lines.append(f"user\n{pick(_SUBJECTS)} {pick(_VERBS)} {pick(_OBJECTS)}?")
        lines.append(f"model\nthought\nsystem\n{pick(_OPENERS)}{pick(_SUBJECTS)} {pick(_VERBS)} it.")
    # paragraphs of 1 to 8 lines so that newline runs are learned too
    chunks, k = [], 0
    while k < len(lines):
        step = 1 + k % 8
        chunks.append("\n".join(lines[k : k + step]) + ("\n\n" if k % 3 == 0 else "\n"))
        k += step
    return chunks


def _train() -> tuple[dict[str, int], list[str]]:
    """Train BPE on the corpus; returns (learned vocab, merges as 'a b' strings)."""
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", "▁")
    # training-only split: a word (or digit, or punctuation run) with its leading ▁ run; newlines apart
    tok.pre_tokenizer = pre_tokenizers.Split(
        Regex(r"▁*[^\W\d_]+|▁*\d|▁*[^\w▁\n]+|▁+|\n+"), behavior="isolated"
    )
    n_fixed = len(CONTROL_TOKENS) + 256
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE_TARGET - n_fixed, show_progress=False)
    tok.train_from_iterator(_corpus(), trainer)
    model = json.loads(tok.to_str())["model"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return model["vocab"], merges


@functools.lru_cache(maxsize=1)
def _build() -> dict[str, Any]:
    learned, merges = _train()
    tokens: list[str] = list(CONTROL_TOKENS)
    types: list[int] = [CONTROL] * len(CONTROL_TOKENS)
    types[3] = UNKNOWN
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [BYTE] * 256
    seen = set(tokens)
    for piece, _ in sorted(learned.items(), key=lambda kv: kv[1]):
        if piece not in seen:
            seen.add(piece)
            tokens.append(piece)
            types.append(NORMAL)
    n_ctrl = len(CONTROL_TOKENS) + 256
    scores = [0.0] * n_ctrl + [-float(i) for i in range(len(tokens) - n_ctrl)]
    return {
        "tokenizer.ggml.model": "gemma4",
        "tokenizer.ggml.pre": "gemma4",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": 2,
        "tokenizer.ggml.eos_token_id": 1,
        "tokenizer.ggml.padding_token_id": 0,
        "tokenizer.ggml.unknown_token_id": 3,
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.ggml.add_space_prefix": False,
        "tokenizer.chat_template": TEMPLATE_PATH.read_text(encoding="utf-8"),
    }


def demo_tokenizer_metadata() -> dict[str, Any]:
    """GGUF `tokenizer.*` keys of the demo tokenizer (same result on every call; lists are copies)."""
    meta = _build()
    return {k: (list(v) if isinstance(v, list) else v) for k, v in meta.items()}
