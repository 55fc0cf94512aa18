"""The prompts of ``specdist bench tasks`` (:mod:`specdist.bench.tasks`): five workloads, written here.

Every prompt is a conversation (a list of ``{"role", "content"}`` messages ending with a user
turn) for the model's chat template. The texts are original to this file (no downloads), in
English, 100 to 600 tokens each once rendered:

- ``chat``: open questions with some context (32 of them, so that 16 clients can send two rounds
  of distinct prompts);
- ``code-edit``: a Python function of 20-40 lines to rewrite with one change (rename a
  variable, add type hints, add a docstring, ...): the answer mostly repeats the input (16 of
  them, so that 16 clients can send distinct prompts);
- ``summarize``: a text of a few paragraphs to summarize;
- ``qa``: a passage and a question whose answer is a span of the passage (extractive);
- ``multi-turn``: a chat history of two or three exchanges, answer the last user turn.

The structured sources (:data:`CODE_EDIT`, :data:`SUMMARIZE`, :data:`QA`, ...) stay
available so tests can check them (each code-edit prompt holds the code it asks to edit, each
QA answer is in its passage).
"""

from __future__ import annotations

# ---------------------------------------------------------------- chat: open questions
CHAT: list[str] = [
    "I have been learning to play the acoustic guitar for about six months. I practise most evenings for "
    "twenty or thirty minutes, usually by playing along with songs I like, and I can now switch between the "
    "basic open chords without stopping. Lately I feel stuck: I play the same handful of songs, my strumming "
    "sounds stiff, and I do not really understand why certain chords sound good together. How should I "
    "structure my practice time over the next few months so that I keep improving? Please suggest a weekly "
    "routine and explain what each part of it is meant to develop.",

    "I am moving to a new city next month for a job, and I will not know anyone there. I work from home "
    "three days a week, I am fairly introverted, and in my current town most of my friends are people I "
    "met at university years ago. I would like to build a social life in the new place without forcing "
    "myself into situations I hate, such as loud bars or large networking events. What are some practical "
    "ways to meet people and turn acquaintances into actual friends over the first year? I would also like "
    "to know how to keep in touch with my old friends without it feeling like a chore.",

    "My apartment has a small balcony that faces south-west and gets direct sun from about noon until "
    "evening. It is roughly two metres by one metre, on the fourth floor, and it can be quite windy. I "
    "have never grown anything before, but I would like to grow some of my own vegetables and herbs this "
    "summer. What would you recommend growing in containers in a space like this, what kind of pots and "
    "soil should I buy, and what are the most common mistakes beginners make? I can spend about fifteen "
    "minutes a day on it.",

    "I am a junior backend developer and I keep hearing that some services use TCP while others, such as "
    "video calls or online games, prefer UDP. I understand that TCP is reliable and UDP is not, but I do not "
    "have a good mental model of what that actually means in practice, or of what a developer gives up or "
    "gains by choosing one over the other. Could you explain the differences between the two protocols as "
    "if you were teaching a colleague, with a few concrete examples of applications and why each one picked "
    "the protocol it uses? Please also mention where newer protocols fit in.",

    "My partner and I are trying to decide whether we should keep renting or buy a home in the next two "
    "years. We both have stable jobs, some savings, and no children yet, although we might have them later. "
    "House prices in our area have risen a lot, and friends keep telling us that renting is throwing money "
    "away, but we also like the flexibility of being able to move. What factors should we consider when "
    "making this decision, and how can we compare the real costs of renting and owning in a fair way? We "
    "are not looking for a single answer, just a clear way to think about it.",

    "We are planning a five-day family holiday in a coastal town during a season when it rains a lot. We "
    "will travel with two children, aged six and nine, who get bored quickly and have a lot of energy. We "
    "will have a car, a modest budget, and a rented cottage with a small kitchen. I would like a rough "
    "plan with ideas for indoor and rainy-day activities, a few things we could do outside when the weather "
    "clears, and some tips for keeping everyone in a good mood when plans change at the last minute. What "
    "would you suggest?",

    "I have a job interview next week for a data analyst position at a mid-sized retail company. I have "
    "a degree in economics, I know SQL and some Python, and I have built a few dashboards in my current "
    "role, but this would be my first job with analyst in the title. The posting mentions stakeholder "
    "communication, A/B testing and forecasting. How should I prepare during the coming week? I would like "
    "to know what kinds of questions I am likely to be asked, how to talk about my previous projects, and "
    "what questions I should ask the interviewers at the end.",

    "I lead a team of seven engineers, and our weekly planning meeting has turned into a ninety-minute "
    "session that most people seem to dread. People join late, the discussion often drifts into technical "
    "details that concern only two or three people, and at the end we are not always sure what was decided. "
    "A few team members have started keeping their cameras off and working on other things during the "
    "call. How can I restructure this meeting so that it is shorter and more useful? Please give concrete "
    "suggestions about the agenda, the roles, and what should happen before and after the meeting.",

    "I started running three months ago and can now run five kilometres without stopping, three times a week. "
    "A friend suggested we sign up for a half marathon that takes place in four months. I am thirty-eight, "
    "slightly overweight, and I sometimes feel a dull ache in my left knee after longer runs. Is four months "
    "enough to prepare safely? How should I increase my distance week by week, and what should I do about the "
    "knee? I have about forty minutes on weekday mornings and more time at weekends, and I would rather avoid "
    "getting injured before the race even if that means a slower finish.",

    "Our small bakery sells bread and pastries in a neighbourhood with a lot of new apartment buildings. "
    "Sales have been flat for a year even though the area keeps growing. We do not have much money for "
    "advertising, and neither of us knows much about social media. What low-cost things could we try over the "
    "next six months to attract the new residents, and how would we know which of them actually work? We open "
    "at seven in the morning, close at three in the afternoon, and have a small front window and a pavement "
    "sign that most people walk straight past.",

    "I want to read more books, but every year I buy a pile of them and finish only two or three. I commute "
    "by train for forty minutes each way, I am usually tired in the evenings, and I tend to pick up my phone "
    "whenever I have a spare moment. How can I build a reading habit that lasts? I would also like some "
    "advice on choosing books I will actually enjoy instead of the ones I feel I ought to read. I like "
    "history, crime novels and books about science, but I often give up on books that start slowly or that "
    "everyone else seems to love.",

    "My grandmother is eighty-four and lives alone in a two-storey house about an hour away from us. She is "
    "still independent and proud of it, but she has fallen twice this year and sometimes forgets to take her "
    "medication. She refuses to talk about moving. How can we make her home safer and keep an eye on her "
    "health without making her feel that we are taking away her independence? How should we raise the "
    "subject? My brother and I share the visits, but we both work full time and live some distance away, so "
    "we can see her only once a week each at most.",

    "I am a secondary school teacher and next term I will teach a class of thirty fourteen-year-olds who, "
    "according to their previous teacher, are difficult: they talk constantly, several refuse to do homework, "
    "and a few are openly rude. I have taught for three years, mostly with calmer groups. What should I do in "
    "the first two weeks to set expectations, and how should I handle disruption without turning every lesson "
    "into a battle? The school has a behaviour policy with detentions and phone calls home, but the students "
    "seem to know that the consequences rarely follow, and I want to avoid shouting.",

    "I would like to learn Spanish well enough to hold everyday conversations before a long trip to South "
    "America in ten months. I studied French at school but have forgotten most of it. I can spend about "
    "thirty minutes on weekdays and a couple of hours at the weekend. Which mix of apps, classes, books and "
    "conversation practice would you recommend, and how should my plan change as I progress? I learn best "
    "when I can see how a language is built, I get bored with flashcards after a few days, and I would like "
    "to be able to follow simple podcasts by the end.",

    "Our family has one car that is twelve years old and has started needing expensive repairs. We drive "
    "about twelve thousand kilometres a year, mostly short trips in town, with a few long drives to visit "
    "relatives. We are considering an electric car, a hybrid, or simply another used petrol car. We can "
    "charge at home. How should we compare these options, and which costs do people usually forget when they "
    "decide? We have a budget of about twenty thousand, we could also lease, and we would like to keep the "
    "next car for at least eight to ten years if possible.",

    "I manage a small online shop and I am worried about the security of our website. It runs on a popular "
    "e-commerce platform with a dozen plugins, I am the only person with administrator access, and we store "
    "customer addresses but not card numbers. I am not a security expert. What are the most important things "
    "I should check or change this month, and what should I do if I ever suspect a breach? The site handles "
    "about fifty orders a week, the platform sends me update notices that I often postpone, and a part-time "
    "helper packs the orders using a separate account with fewer rights.",

    "My teenage son spends six or seven hours a day on his phone and games console during the holidays. He is "
    "polite and does well at school, but he hardly goes outside and stays up very late. Every time I raise "
    "the subject it turns into an argument. How can I talk with him about this in a way that he will take "
    "seriously, and what kind of limits are reasonable for a fifteen-year-old? His father and I disagree on "
    "how strict to be, which makes things harder, and his younger sister has started copying his habits as "
    "well.",

    "I have about ten thousand in savings and no debt apart from a small student loan with a low interest "
    "rate. I am twenty-nine, my job is fairly secure, and my employer offers a pension plan with matching "
    "contributions that I have not joined yet. Friends talk about index funds, property and cryptocurrencies. "
    "How should I think about what to do with my savings, and in what order should I tackle these choices? I "
    "would also like to keep some money available for emergencies and perhaps for a deposit on a flat in five "
    "or six years, if prices allow.",

    "I volunteer at a community garden that has forty plots and a waiting list. Every year a few plot holders "
    "stop looking after their plots by midsummer, weeds spread to the neighbouring plots, and the people on "
    "the waiting list get frustrated. The garden is run by a committee of volunteers with no paid staff. What "
    "rules and habits could we introduce so that plots are used well, without becoming a bureaucracy that "
    "drives people away? The committee meets once a month, plot fees are very low, and some of the neglectful "
    "plot holders have been members for many years and have friends on the committee.",

    "I sleep badly: I fall asleep quickly but wake up around three or four in the morning and cannot get back "
    "to sleep for an hour or more. I drink two coffees a day, exercise twice a week, and often check emails "
    "in bed. I do not want to take sleeping pills. What could be causing this pattern, and what changes "
    "should I try first? How long should I give each change before deciding whether it works? When I wake up "
    "my mind starts racing about work, I sometimes get up to read or look at my phone, and I feel tired all "
    "afternoon.",

    "I am a freelance graphic designer and I find it hard to set my prices. I usually charge by the hour, but "
    "clients often ask for a fixed price up front, and twice this year a project took twice as long as I "
    "expected. Some clients also ask for endless small revisions. How should I price my work, what should go "
    "into a simple contract, and how can I say no to extra requests without losing clients? I have about ten "
    "regular clients, most of them small businesses, and I would like to earn enough to take a proper holiday "
    "without worrying about the months that follow.",

    "We adopted a rescue dog, a two-year-old mixed breed, three weeks ago. He is friendly with people but "
    "barks and lunges at other dogs on walks, pulls hard on the lead, and chews things when he is left alone "
    "for more than an hour. We both work, although one of us is at home two days a week. Where should we "
    "start with his training, and when would it make sense to hire a professional trainer? He is also nervous "
    "around bicycles and runners, and he sometimes growls when we try to take toys from him, which worries us "
    "because friends with children visit often.",

    "I have been asked to give a fifteen-minute talk about my team's project at a company-wide meeting with "
    "about two hundred people. I know the material well, but I get very nervous when I speak in public: my "
    "voice shakes and I tend to rush. The meeting is in three weeks. How should I structure the talk, how "
    "should I prepare the slides, and what can I do to manage my nerves on the day? The audience will include "
    "senior managers who know little about our technical work, and I would like them to understand why the "
    "project matters and what we need from them.",

    "I want to cook more at home instead of ordering takeaway four or five times a week. I can make pasta and "
    "omelettes, but not much else, and I often get home hungry at eight in the evening. My kitchen is small "
    "and I live alone, so food often goes off before I use it. How can I plan simple meals for a week, shop "
    "without wasting food, and learn a few dishes that are quick after work? I have a basic set of pans, a "
    "decent knife and an oven, but no food processor, and I would like meals that are reasonably healthy "
    "without being complicated.",

    "Our town council wants to reduce traffic in the old centre by closing two streets to cars and widening "
    "the pavements. Shop owners are worried that they will lose customers, while many residents welcome the "
    "idea. I have been invited to a public consultation as a resident. What arguments and evidence are "
    "usually raised on each side of such schemes, and what questions should I ask the council so that the "
    "discussion stays constructive? The plan would also remove about forty parking spaces, and deliveries to "
    "the shops would be limited to the early morning, which some owners say is impractical.",

    "I am thinking about leaving my stable job as an accountant to retrain as a software developer. I am "
    "thirty-four, I have a mortgage, and I have done a few online programming courses in the evenings which I "
    "enjoyed. Bootcamps promise a new career in three months, but I am sceptical. How can I test whether this "
    "change is right for me before I quit, and what would a realistic transition plan look like? My partner "
    "supports the idea but is worried about our finances, and I do not know anyone working in software whom I "
    "could ask for an honest opinion.",

    "Every winter our house feels cold and our heating bills keep rising. It is a brick house built in the "
    "nineteen-sixties, with single-glazed windows in two rooms, an old gas boiler and some insulation in the "
    "loft. We cannot afford to do everything at once. Which improvements usually give the best value for "
    "money, in what order should we do them, and what can we do this winter that costs almost nothing? We "
    "expect to stay in the house for at least ten more years, and we are open to borrowing a little if an "
    "improvement clearly pays for itself.",

    "I run a book club of ten people that meets once a month. Lately only four or five people turn up, "
    "discussions are short, and some members admit they have not finished the book. We have been meeting for "
    "three years and I would like to keep the group going. What could we change about how we choose books, "
    "how the meetings run and how often we meet to make people more engaged again? Most of us are in our "
    "forties and fifties, with busy jobs and families, and we tend to choose prize-winning novels that are "
    "often long and rather heavy.",

    "My elderly father has just been diagnosed with type two diabetes. He lives with my mother, who does most "
    "of the cooking, and neither of them likes being told what to eat. The doctor gave them a leaflet but "
    "they found it confusing. How can I help them understand what the diagnosis means for daily life, and how "
    "can they change their meals gradually without feeling that all their favourite food is forbidden? He "
    "likes bread, potatoes and sweet desserts, drinks fruit juice every morning, and walks the dog for about "
    "twenty minutes a day when the weather is good.",

    "I keep a lot of photos and documents on my laptop, and I recently realised that I have no backup at all. "
    "There are about two hundred gigabytes of family photos, tax records and work files. I am not very "
    "technical and I am wary of monthly subscriptions. What is a simple backup routine that would protect me "
    "against a broken laptop, theft or a fire, and how often should I check that it actually works? I use a "
    "laptop for most things and a phone for photos, which are copied to the laptop from time to time when I "
    "remember to do it.",

    "I have just been promoted to manage the team I used to be a member of. Two of my former colleagues also "
    "applied for the job, and one of them seems resentful. I still want to be friendly with everyone, but I "
    "now have to give feedback and make decisions that not everyone will like. How should I handle the first "
    "few months, and how do I set boundaries with people who used to be my peers? Our company has no formal "
    "training for new managers, my own manager is supportive but very busy, and the team has a deadline in "
    "two months that matters a lot.",

    "We want to make our wedding celebration smaller and less expensive than our families expect. Both sets "
    "of parents have offered to contribute money, but they also have strong opinions about the guest list and "
    "the venue. We would prefer about forty guests and a relaxed day. How can we talk with our families about "
    "what we want, and how should we handle the money so that it does not come with conditions? My parents "
    "have hinted that they are hurt by our plans, and my partner's family has a tradition of very large "
    "weddings with more than two hundred guests.",
]

# ---------------------------------------------------------------- code editing: (instruction, code)
CODE_EDIT: list[tuple[str, str]] = [
    (
        "Rename the variable `d` to `counts_by_level` everywhere in this function. Do not change anything "
        "else, and return the complete rewritten function.",
        '''def summarize_log(lines, min_count=1):
    d = {}
    first_seen = {}
    for number, line in enumerate(lines, start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split(maxsplit=2)
        if len(parts) < 3:
            continue
        timestamp, level, message = parts
        level = level.strip("[]").upper()
        if level not in d:
            d[level] = 0
            first_seen[level] = (number, timestamp)
        d[level] += 1
    report = []
    for level in sorted(d, key=lambda name: -d[name]):
        count = d[level]
        if count < min_count:
            continue
        number, timestamp = first_seen[level]
        report.append(f"{level}: {count} (first on line {number} at {timestamp})")
    if not report:
        return "no entries"
    return "\\n".join(report)
''',
    ),
    (
        "Add type hints to the parameters and return values of these three functions (intervals are pairs of "
        "integers). Keep the logic exactly as it is, and return the complete rewritten code.",
        '''def merge_intervals(intervals, gap=0):
    if gap < 0:
        raise ValueError("gap must be >= 0")
    if not intervals:
        return []
    ordered = sorted(intervals, key=lambda pair: (pair[0], pair[1]))
    merged = [list(ordered[0])]
    for start, end in ordered:
        if start > end:
            raise ValueError(f"interval ({start}, {end}) ends before it starts")
        last = merged[-1]
        if start <= last[1] + gap:
            last[1] = max(last[1], end)
        else:
            merged.append([start, end])
    return [(start, end) for start, end in merged]


def total_length(intervals, gap=0):
    total = 0
    for start, end in merge_intervals(intervals, gap):
        total += end - start
    return total


def find_free_slots(busy, day_start, day_end, min_length=1):
    free = []
    cursor = day_start
    for start, end in merge_intervals(busy):
        if start - cursor >= min_length:
            free.append((cursor, start))
        cursor = max(cursor, end)
    if day_end - cursor >= min_length:
        free.append((cursor, day_end))
    return free
''',
    ),
    (
        "Add a docstring to this function that explains what it does, its arguments, what it returns and "
        "what it raises. Do not change the code itself, and return the complete function with the docstring.",
        '''import time


def retry(func, attempts=3, delay=0.5, backoff=2.0, exceptions=(Exception,), on_error=None):
    if attempts < 1:
        raise ValueError("attempts must be at least 1")
    if delay < 0 or backoff < 1:
        raise ValueError("delay must be >= 0 and backoff >= 1")
    wait = delay
    last_error = None
    for attempt in range(1, attempts + 1):
        try:
            return func()
        except exceptions as error:
            last_error = error
            if on_error is not None:
                on_error(attempt, error)
            if attempt == attempts:
                break
            time.sleep(wait)
            wait *= backoff
    raise RuntimeError(f"gave up after {attempts} attempts") from last_error
''',
    ),
    (
        "Rename the function `calc` to `invoice_total` and update every call to it in this module. Change "
        "nothing else, and return the complete rewritten module.",
        '''TAX_RATES = {"standard": 0.2, "reduced": 0.05, "zero": 0.0}


def calc(items, discount=0.0):
    subtotal = 0.0
    tax = 0.0
    for item in items:
        line = item["price"] * item["quantity"]
        rate = TAX_RATES[item.get("tax_class", "standard")]
        subtotal += line
        tax += line * rate
    if not 0.0 <= discount < 1.0:
        raise ValueError("discount must be in [0, 1)")
    subtotal *= 1.0 - discount
    tax *= 1.0 - discount
    return round(subtotal + tax, 2)


def print_invoice(customer, items, discount=0.0):
    print(f"Invoice for {customer}")
    for item in items:
        print(f"  {item['name']}: {item['quantity']} x {item['price']:.2f}")
    total = calc(items, discount)
    if discount:
        print(f"  discount: {discount:.0%}")
    print(f"Total: {total:.2f}")
    return total


def average_invoice(invoices):
    totals = [calc(items, discount) for items, discount in invoices]
    return sum(totals) / len(totals) if totals else 0.0
''',
    ),
    (
        "Replace every `print` call in this function with a call on a module-level logger "
        "(`logger = logging.getLogger(__name__)`), using `info` for progress and `warning` for problems. "
        "Keep everything else as it is and return the complete rewritten code.",
        '''import os
import shutil


def sync_directory(source, destination, dry_run=False):
    if not os.path.isdir(source):
        print(f"source {source} is not a directory")
        return 0
    os.makedirs(destination, exist_ok=True)
    copied = 0
    for root, _dirs, files in os.walk(source):
        relative = os.path.relpath(root, source)
        target_root = os.path.join(destination, relative)
        if not dry_run:
            os.makedirs(target_root, exist_ok=True)
        for name in files:
            src_path = os.path.join(root, name)
            dst_path = os.path.join(target_root, name)
            if os.path.exists(dst_path) and os.path.getmtime(dst_path) >= os.path.getmtime(src_path):
                continue
            print(f"copying {src_path} -> {dst_path}")
            if not dry_run:
                try:
                    shutil.copy2(src_path, dst_path)
                except OSError as error:
                    print(f"could not copy {src_path}: {error}")
                    continue
            copied += 1
    print(f"{copied} files copied")
    return copied
''',
    ),
    (
        "Rewrite every string built with `%` formatting or `str.format` in this function as an f-string. "
        "Keep the output exactly the same and return the complete rewritten function.",
        '''def format_report(title, rows, currency="EUR"):
    lines = []
    lines.append("=" * 40)
    lines.append("Report: %s" % title)
    lines.append("%d rows" % len(rows))
    lines.append("=" * 40)
    total = 0.0
    best_name, best_amount = None, None
    for index, row in enumerate(rows, start=1):
        name = row["name"]
        amount = row["amount"]
        share = row.get("share", 0.0)
        total += amount
        if best_amount is None or amount > best_amount:
            best_name, best_amount = name, amount
        lines.append("{:>3}. {:<20} {:>10.2f} {}".format(index, name, amount, currency))
        if share:
            lines.append("     share of budget: {:.1%}".format(share))
    lines.append("-" * 40)
    lines.append("Total: %.2f %s" % (total, currency))
    if best_name is not None:
        lines.append("Largest item: {} ({:.2f} {})".format(best_name, best_amount, currency))
    if rows:
        lines.append("Average: %.2f %s" % (total / len(rows), currency))
    return "\\n".join(lines)
''',
    ),
    (
        "Rename the parameter `cfg` to `config` everywhere in this function, including inside the nested "
        "helper. Do not change anything else, and return the complete rewritten function.",
        '''def build_connection_string(cfg, include_password=False):
    def get(key, default=None):
        value = cfg.get(key, default)
        if value is None:
            raise KeyError(f"missing setting: {key}")
        return value

    driver = get("driver", "postgresql")
    host = get("host", "localhost")
    port = int(get("port", 5432))
    database = get("database")
    user = get("user")
    if not 0 < port < 65536:
        raise ValueError(f"invalid port {port}")
    credentials = user
    if include_password and cfg.get("password"):
        credentials = f"{user}:{cfg['password']}"
    options = []
    for key in sorted(cfg.get("options", {})):
        options.append(f"{key}={cfg['options'][key]}")
    query = "?" + "&".join(options) if options else ""
    url = f"{driver}://{credentials}@{host}:{port}/{database}{query}"
    if cfg.get("read_only"):
        url += ("&" if query else "?") + "readonly=true"
    return url
''',
    ),
    (
        "Rewrite this function to use `pathlib.Path` instead of `os.path` and `open` with string paths. "
        "Keep its behaviour and its signature, and return the complete rewritten function.",
        '''import json
import os


def load_settings(directory, name="settings.json", defaults=None):
    settings = dict(defaults or {})
    path = os.path.join(directory, name)
    if not os.path.exists(path):
        return settings
    with open(path, encoding="utf-8") as handle:
        data = json.load(handle)
    if not isinstance(data, dict):
        raise ValueError(f"{path} must contain a JSON object")
    settings.update(data)
    local_path = os.path.join(directory, "local_" + name)
    if os.path.isfile(local_path):
        with open(local_path, encoding="utf-8") as handle:
            settings.update(json.load(handle))
    for key, value in list(settings.items()):
        if isinstance(value, str) and value.startswith("./"):
            settings[key] = os.path.normpath(os.path.join(directory, value))
    backup = path + ".bak"
    if not os.path.exists(backup):
        with open(backup, "w", encoding="utf-8") as handle:
            json.dump(data, handle, indent=2)
    return settings
''',
    ),
    (
        "Rename the parameter `xs` to `readings` everywhere in this function. Change nothing else, and return "
        "the complete rewritten function.",
        '''def smooth_series(xs, window=5, clip=None):
    if window < 1:
        raise ValueError("window must be at least 1")
    if not xs:
        return []
    half = window // 2
    smoothed = []
    for index in range(len(xs)):
        start = max(0, index - half)
        stop = min(len(xs), index + half + 1)
        chunk = [value for value in xs[start:stop] if value is not None]
        if not chunk:
            smoothed.append(None)
            continue
        average = sum(chunk) / len(chunk)
        if clip is not None:
            low, high = clip
            average = min(max(average, low), high)
        smoothed.append(round(average, 3))
    missing = sum(1 for value in xs if value is None)
    if missing > len(xs) // 2:
        raise ValueError(f"{missing} of {len(xs)} readings are missing")
    return smoothed
''',
    ),
    (
        "Add a docstring to this function that explains its parameters, what it returns and when it raises. "
        "Do not change the code itself, and return the complete function with the docstring.",
        '''def parse_duration(text, default_unit="s"):
    units = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
    if default_unit not in units:
        raise ValueError(f"unknown default unit {default_unit!r}")
    text = text.strip().lower()
    if not text:
        raise ValueError("empty duration")
    total = 0.0
    number = ""
    for char in text + " ":
        if char.isdigit() or char == ".":
            number += char
            continue
        if char == " ":
            if number:
                total += float(number) * units[default_unit]
                number = ""
            continue
        unit = char
        if char == "m" and text[text.index(char) + 1:text.index(char) + 2] == "s":
            unit = "ms"
        if not number or unit not in units:
            raise ValueError(f"cannot parse duration {text!r}")
        total += float(number) * units[unit]
        number = ""
    return total
''',
    ),
    (
        "Replace the explicit loops that build `by_author` and `titles` with dictionary and list "
        "comprehensions where that is possible. Keep the behaviour the same and return the complete rewritten "
        "function.",
        '''def library_report(books, min_year=None):
    selected = []
    for book in books:
        if min_year is not None and book["year"] < min_year:
            continue
        selected.append(book)
    by_author = {}
    for book in selected:
        by_author.setdefault(book["author"], []).append(book)
    titles = []
    for book in selected:
        titles.append(book["title"].strip())
    lines = [f"{len(selected)} books by {len(by_author)} authors"]
    for author in sorted(by_author):
        works = sorted(by_author[author], key=lambda book: book["year"])
        first, last = works[0]["year"], works[-1]["year"]
        span = f"{first}" if first == last else f"{first}-{last}"
        lines.append(f"  {author}: {len(works)} ({span})")
    longest = max(titles, key=len) if titles else ""
    lines.append(f"longest title: {longest}")
    return "\\n".join(lines)
''',
    ),
    (
        "Make this class raise `KeyError` instead of returning `None` when `get` is asked for a missing key. "
        "Keep everything else as it is and return the complete rewritten class.",
        '''class LRUCache:
    def __init__(self, capacity):
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self.capacity = capacity
        self.items = {}
        self.order = []
        self.hits = 0
        self.misses = 0

    def get(self, key):
        if key not in self.items:
            self.misses += 1
            return None
        self.hits += 1
        self.order.remove(key)
        self.order.append(key)
        return self.items[key]

    def put(self, key, value):
        if key in self.items:
            self.order.remove(key)
        elif len(self.items) >= self.capacity:
            oldest = self.order.pop(0)
            del self.items[oldest]
        self.items[key] = value
        self.order.append(key)

    def stats(self):
        total = self.hits + self.misses
        ratio = self.hits / total if total else 0.0
        return {"size": len(self.items), "hits": self.hits, "misses": self.misses, "hit_ratio": ratio}
''',
    ),
    (
        "Add a `delimiter` keyword parameter (default `\",\"`) to this function and use it instead of the "
        "hard-coded comma. Change nothing else and return the complete rewritten function.",
        '''def read_table(path, required=(), skip_blank=True):
    rows = []
    with open(path, encoding="utf-8") as handle:
        header = handle.readline().rstrip("\\n").split(",")
        header = [name.strip() for name in header]
        missing = [name for name in required if name not in header]
        if missing:
            raise ValueError(f"{path}: missing columns {', '.join(missing)}")
        for number, line in enumerate(handle, start=2):
            line = line.rstrip("\\n")
            if skip_blank and not line.strip():
                continue
            values = [value.strip() for value in line.split(",")]
            if len(values) != len(header):
                raise ValueError(f"{path}:{number}: expected {len(header)} fields, got {len(values)}")
            row = dict(zip(header, values))
            for name in required:
                if not row[name]:
                    raise ValueError(f"{path}:{number}: empty {name}")
            rows.append(row)
    return rows
''',
    ),
    (
        "Replace every `print` call in this function with a call to a module-level logger "
        "(`logger = logging.getLogger(__name__)`, info for progress, warning for problems). Keep everything "
        "else and return the complete rewritten code.",
        '''import os
import shutil


def rotate_logs(directory, keep=5, suffix=".log"):
    if keep < 1:
        raise ValueError("keep must be at least 1")
    names = sorted(name for name in os.listdir(directory) if name.endswith(suffix))
    print(f"found {len(names)} log files in {directory}")
    for name in names:
        path = os.path.join(directory, name)
        for index in range(keep - 1, 0, -1):
            older = f"{path}.{index}"
            newer = f"{path}.{index - 1}" if index > 1 else path
            if os.path.exists(newer):
                if os.path.exists(older):
                    os.remove(older)
                shutil.move(newer, older)
                print(f"moved {newer} to {older}")
        if os.path.exists(path):
            print(f"warning: could not rotate {path}")
        open(path, "w").close()
        print(f"started a new {path}")
    return len(names)
''',
    ),
    (
        "Rename the method `calc_score` to `score` and update every call to it in this class. Change "
        "nothing else, and return the complete rewritten class.",
        '''class Leaderboard:
    def __init__(self, bonus_per_streak=5):
        self.bonus_per_streak = bonus_per_streak
        self.players = {}

    def record(self, name, points, won):
        player = self.players.setdefault(name, {"points": 0, "games": 0, "wins": 0, "streak": 0})
        player["points"] += points
        player["games"] += 1
        if won:
            player["wins"] += 1
            player["streak"] += 1
        else:
            player["streak"] = 0
        return self.calc_score(name)

    def calc_score(self, name):
        player = self.players[name]
        if player["games"] == 0:
            return 0
        win_rate = player["wins"] / player["games"]
        return round(player["points"] * (1 + win_rate) + player["streak"] * self.bonus_per_streak, 1)

    def top(self, count=3):
        ranked = sorted(self.players, key=lambda name: self.calc_score(name), reverse=True)
        return [(name, self.calc_score(name)) for name in ranked[:count]]
''',
    ),
    (
        "Change the string formatting in this function from `%` formatting and `str.format` to f-strings. "
        "Keep the output exactly the same and return the complete rewritten function.",
        '''def format_receipt(shop, lines, paid, currency="EUR"):
    if not lines:
        raise ValueError("a receipt needs at least one line")
    width = 40
    out = ["{:^40}".format(shop.upper()), "-" * width]
    total = 0.0
    for name, quantity, price in lines:
        amount = quantity * price
        total += amount
        label = "%dx %s" % (quantity, name)
        out.append("%-28s%12.2f" % (label, amount))
    out.append("-" * width)
    out.append("%-28s%12.2f" % ("TOTAL " + currency, total))
    out.append("%-28s%12.2f" % ("PAID", paid))
    change = paid - total
    if change < 0:
        out.append("{:<28}{:>12.2f}".format("STILL DUE", -change))
    else:
        out.append("{:<28}{:>12.2f}".format("CHANGE", change))
    out.append("{:^40}".format("Thank you, come again!"))
    return "\\n".join(out)
''',
    ),
]

# ---------------------------------------------------------------- summarizing: (instruction, text)
SUMMARIZE: list[tuple[str, str]] = [
    (
        "Summarize the following incident report in four or five sentences for a non-technical manager.",
        """On Tuesday morning the payment service of our online shop was unavailable for about forty minutes, \
from 09:12 to 09:51. During that time customers could browse the catalogue and fill their baskets, but every \
attempt to pay ended with an error page. Around 1,300 checkout attempts failed, and the support team received \
more than two hundred messages.

The cause was an expired TLS certificate on the internal gateway that connects our payment service to the card \
processor. The certificate had been renewed automatically in the certificate store two weeks earlier, but the \
gateway only reads certificates when it starts, and it had not been restarted since the renewal. When the old \
certificate expired at 09:12, the card processor refused every connection.

The on-call engineer was paged at 09:15 by the checkout error alarm. It took about twenty minutes to find the \
cause, because the gateway's own health check kept reporting that it was healthy: it only checked that the \
process was running, not that it could reach the processor. Once the expired certificate was identified, the \
gateway was restarted and payments recovered within a minute.

We have taken three actions. The gateway now reloads certificates without a restart, its health check now makes \
a real test connection to the card processor, and we added an alert that fires thirty days before any \
certificate in production expires. Customers whose payments failed received an email with a discount code.""",
    ),
    (
        "Write a short summary of these meeting notes, listing the decisions that were taken.",
        """The Millbrook town council met on Thursday evening to discuss the proposed cycle lanes on Station Road \
and the High Street. About sixty residents attended, which the chair noted was the largest audience of the year.

The transport officer presented the results of the consultation. Of the 842 responses, 58 percent supported \
protected cycle lanes on Station Road, while opinion on the High Street was split almost evenly. Shop owners on \
the High Street were worried that removing twenty-two parking spaces would reduce the number of customers, \
while parents from the primary school argued that the current road is too dangerous for children to cycle to \
school.

After a long discussion, the council voted seven to two to build the Station Road lanes next spring, funded by \
the regional transport grant. For the High Street, the council decided not to remove any parking for now. \
Instead, it will run a six-month trial of a 20 mph speed limit and two new pedestrian crossings, and the \
transport officer will count cyclists, pedestrians and parking use before and after the trial.

Councillor Ahmed asked for a separate study of delivery vehicles, which often park on the pavement in the \
mornings. The council agreed to add this to the agenda of the next meeting in two months. The chair closed the \
meeting by thanking the residents and reminding them that the full consultation report is available at the \
library and on the council website.""",
    ),
    (
        "Summarize the following text in one paragraph.",
        """Sourdough bread is leavened by a culture of wild yeasts and lactic acid bacteria rather than by \
commercial baker's yeast. The culture, usually called a starter, is a mixture of flour and water that has been \
left to ferment and is then fed regularly with fresh flour and water. A healthy starter rises and falls in a \
predictable rhythm after each feeding, and bakers use it when it is near its peak.

The yeasts in the starter produce carbon dioxide, which is trapped by the gluten network in the dough and makes \
the bread rise. The bacteria produce lactic and acetic acids, which give sourdough its characteristic tang. The \
balance between the two acids depends on temperature and on how firm the starter is: a warm, wet starter tends \
to produce a milder, more yoghurt-like flavour, while a cool, stiff starter favours the sharper acetic acid.

Because the wild culture works more slowly than commercial yeast, sourdough usually needs a long fermentation, \
often overnight in the refrigerator. Many bakers believe this slow process improves both the flavour and the \
texture of the crust. The acidity also helps the bread stay fresh for longer, since it slows the growth of mould.

Maintaining a starter takes some discipline. If it is not fed, the culture becomes too acidic and sluggish, and \
a grey liquid often collects on top. Most starters can be revived with a few regular feedings, which is why \
some families keep the same culture going for many years.""",
    ),
    (
        "Summarize these release notes in three bullet points for our users.",
        """Version 4.2 of Notebook, our note-taking app, is available today on all platforms. This release \
focuses on search, offline use and sharing, the three areas users asked about most in last quarter's survey.

Search has been rebuilt from the ground up. It now finds words inside attached PDF files and images with \
printed text, it tolerates small spelling mistakes, and results appear as you type instead of after you press \
enter. On a collection of ten thousand notes, the first results now appear in under a tenth of a second on a \
typical laptop.

Offline mode is now available on the free plan. Notes you have opened in the last thirty days are kept on your \
device, and any changes you make without a connection are synchronised when you are back online. If the same \
note was edited on two devices while offline, Notebook keeps both versions and asks you which one to keep, \
instead of silently choosing the latest one as before.

Sharing is simpler. You can now share a single note or a whole folder with a link, choose whether people with \
the link can only read or also edit, and set the link to expire after a day, a week or a month. Shared folders \
show who made each change.

This release also fixes more than forty bugs, including the one that sometimes duplicated checklists when they \
were edited on a phone. Version 4.1 will continue to receive security updates until the end of the year.""",
    ),
    (
        "Give a concise summary of the following passage, suitable for a newsletter.",
        """Scientists have long suspected that sleep does more than simply rest the body. Over the last few \
decades, many studies have suggested that sleep plays an active role in memory, helping the brain to keep what \
it has learned during the day and to discard some of what it does not need.

In a typical experiment, volunteers learn a list of word pairs or a simple motor task, such as typing a \
sequence of keys, in the evening. Half of them then sleep normally, while the other half stay awake. When both \
groups are tested the next day, those who slept usually remember more, even when the experiment is arranged so \
that both groups are tested at the same time of day and are equally alert.

Researchers think that during deep sleep the brain replays recent experiences, strengthening the connections \
that represent them and gradually moving the memories into long-term storage. Dream sleep may play a different \
role, for example in linking new information to older memories or in processing emotions, although this is \
still debated.

These findings have practical consequences. Students who stay up all night before an exam may remember less \
than those who study less but sleep well. Some researchers are also exploring whether gentle sounds played \
during deep sleep can strengthen specific memories. The results so far are interesting, but most studies are \
small, and scientists caution that much remains to be understood.""",
    ),
    (
        "Summarize this internal memo in a few sentences, keeping every date and number.",
        """To all staff: from the first of March, the company will move to a new hybrid working policy. This \
memo explains what will change and why.

Over the past year we have asked every team how they prefer to work. Most people told us that they value the \
flexibility of working from home, but that some tasks, such as planning, onboarding new colleagues and solving \
difficult problems together, work better in person. The new policy tries to keep the best of both.

Each team will choose two anchor days per week when everyone is expected in the office. Teams should agree on \
their anchor days with their manager by the fifteenth of February, and the days should stay the same for at \
least three months so that colleagues from other teams can plan around them. On the other three days, people \
can work from home or from the office as they prefer.

To make the office more useful on anchor days, we will convert the third floor into meeting rooms and open \
collaboration areas, and reduce the number of fixed desks from 240 to 180. Desks can be booked up to two weeks \
in advance through the usual booking system.

We will also increase the home office allowance from 300 to 450 euros per year, paid in January. The policy \
will be reviewed in September, based on a survey and on office usage data. Please send any questions to your \
manager or to the people team.""",
    ),
    (
        "Summarize the history told in this text in five sentences or fewer.",
        """The lighthouse at Gull Point was built in 1871, after a winter in which three ships were wrecked on \
the rocks below the headland. The local fishing community had asked for a light for many years, and the \
disasters finally persuaded the harbour authority to pay for it. The tower was built from granite quarried a few \
miles inland and carried to the site on carts.

For its first sixty years the light was kept by families who lived in the small cottage at the foot of the \
tower. The keepers trimmed the wicks, cleaned the great lens every morning and wound the clockwork that turned \
it through the night. In storms they sometimes stayed awake for two or three days in a row. The logbooks they \
kept record not only the weather and passing ships but also births, weddings and the occasional rescue.

In 1932 the lamp was converted to electricity, and in 1978 the light was fully automated, so the last keeper \
and his wife moved to the village. For some years the empty cottage was used only to store equipment, and the \
building slowly fell into disrepair.

In 2009 a group of volunteers formed a trust to save the site. With money from donations and a heritage grant, \
they repaired the roof, restored the keepers' rooms and opened a small museum displaying the original logbooks. \
The light itself still works and is maintained by the national lighthouse service.""",
    ),
]

# ---------------------------------------------------------------- extractive QA: (passage, question, answer span)
QA: list[tuple[str, str, str]] = [
    (
        """The Riverside Community Library is open from 9 a.m. to 7 p.m. on weekdays and from 10 a.m. to 4 p.m. \
on Saturdays; it is closed on Sundays and public holidays. Membership is free for anyone who lives, works or \
studies in the district, and a library card can be issued on the spot with proof of address. Members may \
borrow up to twelve items at a time, of which no more than four may be DVDs or video games. Books are lent for \
three weeks and can be renewed twice online or by phone, unless another member has reserved them. DVDs and \
games are lent for one week and cannot be renewed. Late returns are charged at 20 cents per item per day for \
adults, while children's accounts are never charged. The library also offers free Wi-Fi, six public computers \
that can be booked for one hour at a time, and a quiet study room on the first floor.""",
        "How many items can a member borrow at the same time?",
        "up to twelve items",
    ),
    (
        """The Halden Marsh nature reserve covers about 340 hectares of reed beds, wet meadows and shallow lakes \
on the edge of the estuary. It was established in 1987, when the regional water authority stopped draining the \
land for farming and allowed it to flood again in winter. Since then the reserve has become an important \
stopping place for migrating birds. In autumn, up to 15,000 geese rest on the lakes before continuing south, \
and the reed beds are home to one of the few breeding populations of bitterns in the region. The reserve is \
managed by a small team of four rangers with the help of volunteers, who cut back the reeds in rotation so that \
the habitat stays varied. Visitors can follow a five-kilometre boardwalk that starts at the visitor centre and \
passes three bird hides. Dogs are not allowed on the boardwalk between March and July, during the nesting \
season.""",
        "When are dogs not allowed on the boardwalk?",
        "between March and July",
    ),
    (
        """Trains on the Coastal Line run every thirty minutes between Northport and Saltham from 6:00 in the \
morning until 20:00, and every hour after that. The journey takes 52 minutes, with stops at Elm Bridge, \
Carrow and the airport. On Sundays the first train leaves Northport at 8:15, and the service runs hourly all \
day. The last train from Northport to Saltham leaves at 23:40 every day of the week, while the last train in \
the other direction leaves Saltham at 23:10. Bicycles can be carried free of charge outside the morning peak, \
which runs from 7:00 to 9:30 on weekdays, but space is limited to six bicycles per train. Tickets bought on the \
train cost more than tickets bought at a station machine or in the app, except at Carrow, which has no ticket \
machine.""",
        "When does the last train from Northport to Saltham leave?",
        "23:40",
    ),
    (
        """The Alto 3 coffee grinder comes with a two-year warranty that covers defects in materials and \
workmanship when the grinder is used in a household. The warranty starts on the date of purchase shown on the \
receipt. During the warranty period, the manufacturer will repair or replace a faulty grinder free of charge; \
if the same model is no longer available, it may be replaced with a model of equal or higher value. The \
warranty does not cover the grinding burrs, which wear with use and should be replaced after roughly 500 \
kilograms of coffee, nor damage caused by grinding anything other than roasted coffee beans. Commercial use, \
for example in a café or an office with more than ten people, reduces the warranty to six months. To make a \
claim, customers should contact the support team with the serial number, which is printed under the base of the \
grinder, and a copy of the receipt.""",
        "Where is the serial number of the grinder printed?",
        "under the base of the grinder",
    ),
    (
        """The harbour town of Port Evering holds its lantern festival on the last weekend of September. The \
tradition began in 1952, when the fishing fleet returned safely from a storm that had been expected to sink \
several boats, and the families lit lanterns along the harbour wall to guide them in. Today the festival lasts \
two days. On Saturday afternoon, children make paper lanterns in workshops held in the old fish market, and in \
the evening a procession carries them from the church square down to the harbour. The highlight comes on \
Sunday night, when around three thousand floating lanterns are released onto the water of the inner harbour. \
The organisers ask visitors not to bring their own lanterns, because only biodegradable ones made from rice \
paper and bamboo are allowed. Parking in the town centre is closed for the whole weekend, and a free shuttle \
bus runs from the car park at the leisure centre.""",
        "What happens on Sunday night of the festival?",
        "around three thousand floating lanterns are released onto the water of the inner harbour",
    ),
    (
        """Tides are the regular rise and fall of the sea surface caused mainly by the gravitational pull of \
the Moon, and to a lesser extent of the Sun, combined with the rotation of the Earth. Most coastlines see two \
high tides and two low tides roughly every 24 hours and 50 minutes, which is why high tide arrives about fifty \
minutes later each day. When the Sun, the Moon and the Earth are roughly in line, at new moon and full moon, \
their pulls add up and produce spring tides, which have the largest difference between high and low water. \
When the Sun and the Moon are at right angles to each other, at the first and last quarter of the Moon, the \
difference is smallest; these are called neap tides. The shape of the coast and of the sea floor has a strong \
effect on the height of the tide, so that some narrow bays see a range of more than ten metres while some \
enclosed seas have almost no tide at all.""",
        "What are the tides with the largest difference between high and low water called?",
        "spring tides",
    ),
    (
        """Our team's deployment tool, Shipyard, reads its settings from a file called shipyard.toml at the \
root of each repository. The file must define a service name and at least one environment; every environment \
needs a cluster and a number of replicas. If the replicas setting is missing, Shipyard refuses to deploy rather \
than guessing a default. Deployments to the staging environment start automatically after every merge to the \
main branch, while deployments to production must be approved by a member of the owning team in the chat \
channel. A production deployment rolls out to one replica first and waits ten minutes, watching the error rate; \
if the error rate stays below one percent, the remaining replicas are updated in batches of twenty-five \
percent. Any deployment can be rolled back with the command shipyard rollback followed by the environment name, \
which restores the previous version within about two minutes.""",
        "How long does a production deployment wait after updating the first replica?",
        "ten minutes",
    ),
]

# ---------------------------------------------------------------- multi-turn: histories ending with a user turn
MULTI_TURN: list[list[dict[str, str]]] = [
    [
        {"role": "user", "content": "I want to start running. I am 35, a bit overweight, and I have not done "
                                    "any sport for years. Where should I begin?"},
        {"role": "assistant", "content": "A good place to begin is a walk-run plan. Go out three times a week "
                                         "for about thirty minutes, alternating one minute of easy running with "
                                         "two minutes of brisk walking. Over eight to ten weeks, slowly increase "
                                         "the running intervals and shorten the walks, until you can run for "
                                         "thirty minutes without stopping. Run slowly enough that you could hold "
                                         "a conversation, and take a rest day between sessions."},
        {"role": "user", "content": "That sounds doable. What kind of shoes should I buy? The sports shop near "
                                    "me has dozens of models and the prices range from 40 to 200 euros."},
        {"role": "assistant", "content": "You do not need the most expensive pair. Look for a neutral running "
                                         "shoe with moderate cushioning from a specialist shop, where staff can "
                                         "watch you walk or jog and let you try several models. Choose the pair "
                                         "that feels comfortable straight away, with about a thumb's width of "
                                         "space in front of your longest toe. Shoes in the 80 to 120 euro range "
                                         "are usually more than good enough for a beginner."},
        {"role": "user", "content": "Thanks. After two weeks my knees sometimes ache a little after a run. Should "
                                    "I stop, or is that normal when you start?"},
    ],
    [
        {"role": "user", "content": "Can you explain what a Python list comprehension is?"},
        {"role": "assistant", "content": "A list comprehension is a compact way to build a list from another "
                                         "iterable. Instead of writing a loop that appends to a list, you write "
                                         "the expression and the loop in one line, for example "
                                         "`squares = [n * n for n in range(10)]`. You can also add a condition: "
                                         "`evens = [n for n in numbers if n % 2 == 0]` keeps only the even "
                                         "numbers."},
        {"role": "user", "content": "Nice. Is there something similar for dictionaries? I have a list of user "
                                    "records, each a dict with 'id' and 'name', and I want a dict from id to "
                                    "name."},
        {"role": "assistant", "content": "Yes, a dictionary comprehension works the same way with a key and a "
                                         "value: `names_by_id = {user['id']: user['name'] for user in users}`. "
                                         "If two records share an id, the later one wins, because each new "
                                         "assignment to the same key replaces the previous value."},
        {"role": "user", "content": "And when should I not use a comprehension? My colleague says they make "
                                    "code harder to read."},
    ],
    [
        {"role": "user", "content": "I'm writing a cover letter for a job as a museum education officer. I have "
                                    "worked as a primary school teacher for six years. How should I open the "
                                    "letter?"},
        {"role": "assistant", "content": "Open with a sentence that connects your teaching experience directly "
                                         "to the role, rather than a generic statement. For example: 'For six "
                                         "years I have designed lessons that turn curious eight-year-olds into "
                                         "confident investigators, and I would love to bring that experience to "
                                         "the learning programme at the City Museum.' Then briefly say why this "
                                         "museum in particular interests you."},
        {"role": "user", "content": "Good. The posting asks for experience with community groups, and I have "
                                    "run an after-school history club and organised two trips to the local "
                                    "archive. How do I present that?"},
        {"role": "assistant", "content": "Give those activities their own short paragraph and describe results, "
                                         "not just duties. Mention how many children took part in the club, what "
                                         "they produced, and how you worked with the archive staff to plan the "
                                         "visits. If parents or other teachers became involved, say so, because "
                                         "that shows you can work with groups beyond your classroom."},
        {"role": "user", "content": "Could you now write a closing paragraph for the letter, in a warm but "
                                    "professional tone, of about four sentences?"},
    ],
    [
        {"role": "user", "content": "Our small web shop stores orders in a single PostgreSQL database. Pages "
                                    "that list a customer's orders have become slow. What should I look at "
                                    "first?"},
        {"role": "assistant", "content": "Start by finding the slow queries. Enable the pg_stat_statements "
                                         "extension or the slow query log, then run EXPLAIN ANALYZE on the query "
                                         "that loads a customer's orders. Very often the problem is a missing "
                                         "index: if the plan shows a sequential scan over the whole orders table "
                                         "filtered by customer_id, an index on that column will help a lot."},
        {"role": "user", "content": "You were right, there was no index on customer_id. I added one and the "
                                    "page is fast again. But the query also sorts by created_at descending and "
                                    "only shows the latest 20 orders. Can the index help with that too?"},
        {"role": "assistant", "content": "Yes. A composite index on (customer_id, created_at DESC) lets "
                                         "PostgreSQL read the latest orders of one customer directly in the "
                                         "right order and stop after 20 rows, with no separate sort step. Once "
                                         "you have it, the single-column index on customer_id is usually "
                                         "redundant and can be dropped."},
        {"role": "user", "content": "Great. Is it safe to create that index on the live database during the "
                                    "day, while customers are placing orders?"},
    ],
    [
        {"role": "user", "content": "I'd like to cook a vegetarian dinner for six people on Saturday. One guest "
                                    "cannot eat nuts. Can you suggest a main course?"},
        {"role": "assistant", "content": "A mushroom and lentil shepherd's pie works well for a group. Cook "
                                         "onions, carrots and garlic, add chopped mushrooms and cooked green "
                                         "lentils, then simmer them with tomato paste, thyme and vegetable stock "
                                         "until thick. Top with mashed potatoes and bake until golden. It "
                                         "contains no nuts and can be prepared a day ahead."},
        {"role": "user", "content": "Sounds good. What could I serve as a starter that is light and can be "
                                    "prepared in advance?"},
        {"role": "assistant", "content": "A chilled cucumber and yoghurt soup with dill is light and can be made "
                                         "the day before. Alternatively, a salad of roasted beetroot, orange "
                                         "slices and soft goat's cheese with a simple vinaigrette is colourful "
                                         "and takes little work on the day. Both are nut-free, as long as you "
                                         "check the labels of any store-bought cheese or dressing."},
        {"role": "user", "content": "I'll do the beetroot salad. Can you give me a shopping list for all three "
                                    "parts, starter, main course and a simple dessert of your choice, for six "
                                    "people?"},
    ],
    [
        {"role": "user", "content": "What is the difference between weather and climate?"},
        {"role": "assistant", "content": "Weather describes the state of the atmosphere at a particular place "
                                         "and time: today's temperature, rain, wind and cloud. Climate describes "
                                         "the typical weather of a region over a long period, usually thirty "
                                         "years or more, including averages and how much conditions vary. A "
                                         "common way to put it is that climate is what you expect and weather is "
                                         "what you get."},
        {"role": "user", "content": "So if we have an unusually cold winter, does that mean the climate is not "
                                    "getting warmer?"},
        {"role": "assistant", "content": "No. A single cold winter is weather, and one season can be colder or "
                                         "warmer than average for many reasons, such as ocean patterns or a "
                                         "blocked jet stream. Climate trends are measured over decades and over "
                                         "the whole planet. A warming climate still has cold winters, they just "
                                         "become less frequent, while very hot periods become more common."},
        {"role": "user", "content": "How can I explain this to my ten-year-old daughter in a simple way, maybe "
                                    "with an example from everyday life?"},
    ],
    [
        {"role": "user", "content": "I manage a support team of five people and we use a shared inbox. Emails "
                                    "sometimes get answered twice, and sometimes not at all. Any ideas?"},
        {"role": "assistant", "content": "The usual cause is that nobody clearly owns each message. Most help "
                                         "desk tools let you assign every incoming email to one person, either "
                                         "automatically in rotation or by whoever clicks first. Combine that "
                                         "with a rule that an unassigned email older than one hour is picked up "
                                         "by the person on triage duty that day, and add a few shared statuses "
                                         "such as waiting for customer and solved."},
        {"role": "user", "content": "We are switching to a help desk tool next month. How should we measure "
                                    "whether the new setup actually works better?"},
        {"role": "assistant", "content": "Measure a few things before and after the switch: the time to first "
                                         "response, the time to resolution, the share of tickets that are "
                                         "reopened, and the number of messages that receive two answers or none. "
                                         "Also ask customers one short satisfaction question when a ticket is "
                                         "closed. Record two or three weeks of data with the old inbox first, so "
                                         "you have a baseline to compare against."},
        {"role": "user", "content": "My team is worried that these numbers will be used to judge them "
                                    "individually. How should I introduce the measurements to them?"},
    ],
]


def _code_edit_prompt(instruction: str, code: str) -> str:
    return f"{instruction}\n\n```python\n{code.rstrip()}\n```"


def _summarize_prompt(instruction: str, text: str) -> str:
    return f"{instruction}\n\n{text}"


def _qa_prompt(passage: str, question: str) -> str:
    return ("Answer the question using only the passage below. Quote the words of the passage that answer it.\n\n"
            f"Passage:\n{passage}\n\nQuestion: {question}")


def _user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


# task name -> its prompts, each a conversation (messages ending with a user turn), in a fixed order
TASKS: dict[str, list[list[dict[str, str]]]] = {
    "chat": [_user(q) for q in CHAT],
    "code-edit": [_user(_code_edit_prompt(i, c)) for i, c in CODE_EDIT],
    "summarize": [_user(_summarize_prompt(i, t)) for i, t in SUMMARIZE],
    "qa": [_user(_qa_prompt(p, q)) for p, q, _ in QA],
    "multi-turn": [list(m) for m in MULTI_TURN],
}
