"""The prompts of ``specdist bench tasks`` (:mod:`specdist.bench.tasks`): five workloads, written here.

Every prompt is a conversation (a list of ``{"role", "content"}`` messages ending with a user
turn) for the model's chat template. The texts are original to this file (no downloads), in
English, 100 to 600 tokens each once rendered:

- ``chat``: open questions with some context (64 of them, so that 16 clients can send four rounds
  of distinct prompts);
- ``code-edit``: a Python function of 20-40 lines to rewrite with one change (rename a
  variable, add type hints, add a docstring, ...): the answer mostly repeats the input (32 of
  them, so that 16 clients can send two rounds of distinct prompts);
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

    "I have always wanted to be able to draw, but I gave up as a child because my pictures never looked like "
    "what I saw. I am now forty-two, I have a desk by a window, a sketchbook and a few pencils, and I can "
    "spare about twenty minutes most evenings. I would like to be able to sketch people in cafés and the "
    "buildings in my street within a year or so. Where should a complete beginner start, which exercises are "
    "worth repeating, and how do I stop comparing my drawings with the work of artists I follow online?",

    "Our team of five developers works on a single web application, and our Git history has become a mess. "
    "Some people commit straight to the main branch, others keep feature branches open for weeks, and "
    "merging them is painful. We deploy once a week, usually on Thursday, and we sometimes need to ship an "
    "urgent fix in between. Could you compare a few common branching strategies, such as trunk-based "
    "development and long-lived release branches, and tell us which one might suit a team like ours? I would "
    "also like some simple rules for pull requests that people will actually follow.",

    "Our children have both left home, and my wife and I are left with a four-bedroom house full of things "
    "we have not used in years: boxes of toys, old school work, furniture from relatives and a garage we can "
    "no longer park in. Every time we start sorting, we argue about what to keep or we get lost in old "
    "photos. We would like to clear most of it over the next six months. How should we go about it room by "
    "room, and how do we decide what to sell, give away or keep without upsetting each other or the "
    "children?",

    "A friend and I want to start a podcast about local history, interviewing older residents and people who "
    "run small museums in our region. We have no audio experience, a small budget of a few hundred euros, "
    "and each of us could give about five hours a week. We would like to publish an episode every two weeks. "
    "What equipment do we really need, how should we record interviews in people's homes, and how much "
    "editing is reasonable for beginners? We would also like to know how podcasts like ours usually find "
    "their first listeners, and whether we need written consent from the people we interview.",

    "I have started brewing beer at home with a simple kit: a fermenting bucket, a hydrometer and tins of "
    "malt extract. The first two batches were drinkable, but the second one tasted slightly sour and a bit "
    "like cider. My kitchen stays warm in summer, and I clean everything with washing-up liquid and hot "
    "water. I would like to improve steadily and perhaps move on to brewing from grains next year. What "
    "might have caused the off flavour, what should I change in my routine, and which skills are worth "
    "learning next? I would rather spend money on a few useful pieces of equipment than on gadgets.",

    "I have just received a job offer from a software company for a senior engineer position. The salary is "
    "about ten percent higher than what I earn now, but lower than I had hoped, and the offer letter also "
    "mentions share options, a yearly bonus and twenty-five days of holiday. The recruiter has asked me to "
    "reply by Friday. I have never negotiated an offer before and I am worried that asking for more could "
    "make them withdraw it. How should I approach the conversation, what can I reasonably ask for besides "
    "salary, and how should I phrase it?",

    "I have joined a company that maintains a ten-year-old Python application with almost no automated "
    "tests. Every release breaks something, and people are afraid to refactor anything. My manager has given "
    "me a few weeks to improve the situation, but we cannot stop shipping features. Parts of the code read "
    "directly from the database and call external services inside long functions. Where should I start "
    "adding tests, which kinds of tests give the most confidence for the least effort in a codebase like "
    "this, and how do I convince my colleagues to keep writing them once the few weeks are over?",

    "I am thirty-six and I never learned to swim properly. I can stay afloat for a few seconds in shallow "
    "water, but I panic when my feet cannot touch the bottom, and putting my face in the water makes me feel "
    "as if I cannot breathe. My children are starting swimming lessons and I feel embarrassed that I cannot "
    "join them in the deep end. Is it realistic to become a confident swimmer at my age? Should I take "
    "private lessons or join an adult group, and what can I do about the panic? I can get to a pool twice a "
    "week, early in the morning.",

    "We have a five-year-old cat who has always been the only pet in our flat, and we are thinking about "
    "adopting a second cat from a shelter. Our cat is affectionate with us but hisses at the neighbour's cat "
    "through the window. The flat has three rooms and a small balcony with a net. How should we choose a cat "
    "that is likely to get along with ours, and how should we introduce them during the first weeks? I would "
    "also like to know which signs mean that it is not working and what we should do then.",

    "This summer I would like to do my first multi-day hiking trip: four days on a marked trail in the "
    "mountains, sleeping in huts where possible and in a small tent for one night. I walk a lot at weekends, "
    "but I have never carried a heavy pack for several days in a row. I will go with a friend who is fitter "
    "than me. What should we pack, how heavy should our rucksacks be, and how should we train over the next "
    "three months? I would also like advice on what to do if the weather turns bad, since neither of us has "
    "used a map and compass for years.",

    "I share a flat with two other people in their twenties. We get along well, but the kitchen and bathroom "
    "are a constant source of tension: one flatmate never washes up, another leaves the rubbish until it "
    "overflows, and I end up cleaning more than my share and feeling resentful. We have tried a chore chart "
    "on the fridge, which everybody ignored after two weeks. How can I bring this up without creating a bad "
    "atmosphere, and what kind of arrangement tends to work for shared flats? We have also discussed paying "
    "for a cleaner, but money is tight for at least one of us.",

    "I am in the final year of a doctorate in biology and I have about eight months left to write my thesis. "
    "My experiments are mostly done, but whenever I sit down to write I end up reading papers, tidying my "
    "references or re-running analyses instead. My supervisor is kind but rarely sets deadlines, and I work "
    "alone most days. How can I break the writing into manageable pieces, set up a routine that keeps me "
    "producing text, and deal with the feeling that every chapter must be perfect before anyone sees it? I "
    "also teach two days a week.",

    "Some neighbours and I would like to set up a monthly repair café in our community hall, where "
    "volunteers help people fix broken toasters, bicycles, clothes and lamps instead of throwing them away. "
    "A few of us have practical skills, and the hall is free on Saturday mornings. We are unsure about "
    "insurance, about which repairs are too risky for volunteers, and about how to avoid long queues that "
    "put people off. How should we organise the first few events, and what tools and rules should we have in "
    "place from the start? We would also like to attract younger volunteers.",

    "I am building a side project: a web application where amateur sports clubs can record matches, players "
    "and results, and publish league tables. I know some SQL from work, but several tutorials I followed use "
    "document databases such as MongoDB, and people online argue endlessly about which one is better. The "
    "data has clear relationships, but I expect the structure to change as I add features. How should I "
    "choose between a relational database and a document database for a project like this, and what would I "
    "regret later with each choice? I will host it myself on a small cloud server.",

    "My daughter is ten and has become curious about how computer games are made. She is good at maths, "
    "enjoys puzzles, and gets frustrated when things do not work the first time. We have an old laptop at "
    "home, and I work in accounting, so I know very little about programming myself. What would be a good "
    "way for her to start learning to code, which tools or languages suit her age, and how can I support her "
    "without taking over? I would also like to keep it fun so that it does not feel like more homework.",

    "We have a garden of about two hundred square metres and we are thinking of keeping three or four "
    "chickens for eggs. Neither of us has kept animals other than cats, and our neighbours have small "
    "children and a dog. We both work, but one of us is usually home by five. What do we need to know before "
    "buying chickens, what kind of coop and run would be suitable, and how much daily and weekly work should "
    "we expect? I would also like to know how to protect them from foxes and what to do when we go on "
    "holiday.",

    "I manage a team of eight people spread across three time zones: two in California, four in Germany and "
    "two in India. We only have about one hour a day when everybody is working, and that hour is used up by "
    "meetings. Decisions get delayed because someone is always asleep when a question comes up, and the "
    "people in California feel left out. How can we organise our communication so that more work happens "
    "asynchronously, and which meetings are still worth keeping? Please suggest concrete practices and tools "
    "that we could adopt over the next month, without adding more tools than we really need.",

    "For my birthday I received a mirrorless camera with a kit lens, and so far I have only used the "
    "automatic mode. My photos look fine in daylight, but pictures indoors are blurry or grainy, and I "
    "cannot get the blurred background that I like in portraits. I mostly photograph my family, our walks in "
    "the countryside and the occasional concert. Could you explain aperture, shutter speed and ISO in plain "
    "terms, and suggest a series of exercises that would help me move away from automatic mode over the next "
    "few weeks? I would rather not buy another lens until I understand the one I have.",

    "I have been trying to write a novel for two years. I have a detailed outline, pages of notes about the "
    "characters and a first chapter that I have rewritten at least ten times, but I have never got past "
    "chapter three. It is a mystery set in a small fishing town in the nineteen-fifties. I work full time "
    "and write on Sunday mornings. How can I get a complete first draft written within a year, and should I "
    "keep following my outline or let the story change as I go? I find it hard to keep writing when I know a "
    "scene is weak, and I am tempted to go back and fix it at once.",

    "Our house has three floors, and the wireless internet works well only in the living room where the "
    "router sits. Upstairs video calls freeze, and the garden office my wife uses barely gets a signal at "
    "all. The internet contract itself is fast, around three hundred megabits. A shop assistant tried to "
    "sell us an expensive mesh system, but a friend says a cable would be better. How can I find out where "
    "the real problem is, and what are the options, from cheap to expensive, for getting a reliable "
    "connection in every room? The walls are thick brick and the office is about fifteen metres from the "
    "house.",

    "Next month I will fly from Europe to Australia with my two-year-old son, alone, with a stopover of "
    "three hours in Singapore. The whole trip takes about twenty-four hours. He is very active, naps badly "
    "outside his own cot, and has never been on a plane. I am dreading the flight and the jet lag "
    "afterwards, since we will stay with my parents for three weeks. How should I prepare, what should I "
    "pack in the hand luggage, and how can I help both of us adjust to the time difference once we arrive? "
    "My parents are eager to help but have not looked after a toddler for decades.",

    "I maintain a small open-source library for parsing calendar files. It started as a weekend project, but "
    "now a few thousand projects depend on it, and I receive several issues and pull requests every day. "
    "Many issues are really support questions, some pull requests are large changes that nobody asked for, "
    "and I feel guilty when I ignore them. I do this in my free time and have started to dread opening my "
    "notifications. How can I make maintaining it sustainable, and how do I find and trust co-maintainers? I "
    "would also like to know how to close issues politely without sounding rude to the people who opened "
    "them.",

    "I learned the rules of chess as a child and started playing again online during the winter. My rating "
    "has been stuck around eleven hundred for two months. I play mostly quick games of five or ten minutes, "
    "I often lose pieces to simple tactics, and I do not know any openings beyond the first few moves. I "
    "have about half an hour a day for chess. How should I divide that time between playing, solving puzzles "
    "and studying, and which habits would help me stop making the same mistakes in every game? I also tend "
    "to play badly for the rest of the evening after a loss.",

    "I have just bought my first flat, which is about forty years old, and I would like to handle small "
    "repairs myself instead of calling a tradesman every time. Right now the bathroom tap drips, two doors "
    "scrape on the floor, a few tiles are cracked and I would like to put up some shelves on a wall that "
    "seems hollow. I have never done any of this. Which basic tools should I buy first, which jobs are safe "
    "for a beginner to learn, and which ones should I always leave to a professional? My budget for tools is "
    "about two hundred.",

    "I volunteer for a small charity that supports a local hospice, and I have offered to organise a quiz "
    "night to raise money. We can use a church hall with room for about a hundred people, and we hope to "
    "raise at least two thousand. I have never organised an event like this. How should I set the ticket "
    "price and team size, how many rounds and what kind of questions work well, and what else, such as a "
    "raffle, could bring in more money? I would also like a rough timeline for the next eight weeks of "
    "preparation, and some advice on finding volunteers to help on the night.",

    "My partner and I moved in together last year. I earn about twice as much as she does, and we currently "
    "split rent, bills and groceries fifty-fifty, which leaves her with very little left over each month, "
    "while I save quite a lot. She has not complained, but I feel it is not fair, and I do not want money to "
    "become a source of conflict. What are the common ways couples with different incomes share their costs, "
    "what are the pros and cons of a joint account, and how should we bring it up without it feeling "
    "awkward? We are also thinking about buying a home together in a few years.",

    "On my team, pull requests often wait three or four days for a review, and when a review finally arrives "
    "it is either a quick approval without real reading or a long list of comments about style. People have "
    "started opening huge pull requests to avoid waiting several times, which makes the problem worse. We "
    "are six developers working on a mobile application. What practices would make our code reviews faster "
    "and more useful, and how can we agree on what a review should focus on without spending weeks arguing "
    "about rules? Two of us are juniors who would also like to learn from the reviews.",

    "Our household of four produces a full bin of rubbish every week, and I would like to cut that down. We "
    "already recycle paper and bottles, but a lot of food waste, packaging and plastic still goes into the "
    "general waste. We have a small back garden with a corner that gets little sun, and the council collects "
    "food waste only in some districts, not ours. Would home composting work for us, and what kind of system "
    "would you recommend? I would also welcome other practical ideas for reducing waste that the children, "
    "aged seven and eleven, can take part in.",

    "My sister and I are planning a two-week trip to Japan next spring, our first time in Asia. We like "
    "food, gardens, old temples and walking around cities, but we are not keen on crowds, and neither of us "
    "speaks Japanese. We are thinking of Tokyo, Kyoto and perhaps somewhere in the countryside. How should "
    "we divide our time between places, is a rail pass worth buying, and what should we book in advance? I "
    "would also like some tips on etiquette so that we do not offend anyone by accident. Our budget is "
    "moderate, and we would prefer small traditional inns to large hotels.",

    "I am a data scientist, and my team keeps talking about containers and Docker. I understand that a "
    "container packages an application with its dependencies, but I do not really see how that differs from "
    "a virtual machine, or from a Python virtual environment that I already use every day. Could you explain "
    "what a container actually is, what the operating system does to isolate it, and when I would choose a "
    "container, a virtual machine or just a virtual environment? Examples from data science work, such as "
    "training models or sharing notebooks with colleagues, would help me most.",

    "I am thinking of buying an electric bicycle to commute to work, twelve kilometres each way with a long "
    "hill at the end, instead of taking the bus. I have not cycled regularly in years, my office has a "
    "locked bike room but no showers, and it rains often where I live. Prices range from about one thousand "
    "to more than four thousand. What should I look for in the motor, battery and brakes, how do I stay "
    "reasonably dry and presentable, and how can I make it less likely that the bike gets stolen? I would "
    "also like to know what maintenance it needs.",

    "My husband is Italian, I am Dutch, and we live in England with our daughter, who is two and a half. We "
    "want her to grow up speaking all three languages, but at the moment she mostly answers in English, even "
    "when we speak to her in our own languages. Her nursery is English-speaking, and our families live far "
    "away. Is it realistic to raise a child in three languages, and how should we divide the languages "
    "between us at home? What can we do to keep her interested in Dutch and Italian as she gets older, once "
    "school starts and English takes over even more?",
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
    (
        "Rename the variable `lst` to `passing` everywhere in this function. Do not change anything else, and "
        "return the complete rewritten function.",
        '''def grade_students(scores, thresholds=None, pass_mark="D"):
    if thresholds is None:
        thresholds = [(90, "A"), (80, "B"), (70, "C"), (60, "D")]
    ordered = sorted(thresholds, reverse=True)
    grades = {}
    lst = []
    for student, points in scores.items():
        if not 0 <= points <= 100:
            raise ValueError(f"{student}: score {points} is out of range")
        letter = "F"
        for minimum, grade in ordered:
            if points >= minimum:
                letter = grade
                break
        grades[student] = letter
        if letter <= pass_mark:
            lst.append(student)
    average = sum(scores.values()) / len(scores) if scores else 0.0
    return {
        "grades": grades,
        "passed": sorted(lst),
        "failed": sorted(name for name in grades if name not in lst),
        "average": round(average, 1),
        "pass_rate": len(lst) / len(scores) if scores else 0.0,
    }
''',
    ),
    (
        "Add type hints to both functions and to the `NUMERALS` constant. Keep the logic exactly as it is, and "
        "return the complete rewritten code.",
        '''NUMERALS = [
    (1000, "M"), (900, "CM"), (500, "D"), (400, "CD"), (100, "C"), (90, "XC"),
    (50, "L"), (40, "XL"), (10, "X"), (9, "IX"), (5, "V"), (4, "IV"), (1, "I"),
]


def to_roman(number):
    if not 0 < number < 4000:
        raise ValueError(f"cannot write {number} in Roman numerals")
    parts = []
    for value, symbol in NUMERALS:
        count, number = divmod(number, value)
        parts.append(symbol * count)
    return "".join(parts)


def from_roman(text):
    text = text.strip().upper()
    if not text:
        raise ValueError("empty numeral")
    total = 0
    index = 0
    for value, symbol in NUMERALS:
        while text.startswith(symbol, index):
            total += value
            index += len(symbol)
    if index != len(text) or to_roman(total) != text:
        raise ValueError(f"invalid Roman numeral {text!r}")
    return total
''',
    ),
    (
        "Add a docstring to this function that describes its parameters, the dictionary it returns in both "
        "modes, and the errors it raises in strict mode. Do not change the code itself, and return the complete "
        "function with the docstring.",
        '''from urllib.parse import unquote_plus


def parse_query_string(query, multi=False, strict=False):
    if query.startswith("?"):
        query = query[1:]
    params = {}
    for pair in query.split("&"):
        if not pair:
            continue
        if "=" in pair:
            key, value = pair.split("=", 1)
        elif strict:
            raise ValueError(f"parameter without a value: {pair!r}")
        else:
            key, value = pair, ""
        key = unquote_plus(key)
        value = unquote_plus(value)
        if not key:
            if strict:
                raise ValueError(f"empty parameter name in {pair!r}")
            continue
        if multi:
            params.setdefault(key, []).append(value)
        elif key in params and strict:
            raise ValueError(f"repeated parameter {key!r}")
        else:
            params[key] = value
    return params
''',
    ),
    (
        "Replace the loops that build `active` and `needed` with a list comprehension and a dictionary "
        "comprehension. Keep the behaviour the same and return the complete rewritten function.",
        '''import math


def restock_report(inventory, daily_sales, lead_time_days=7, safety_days=3):
    active = []
    for item in inventory:
        if not item.get("discontinued", False):
            active.append(item)
    needed = {}
    for item in active:
        rate = daily_sales.get(item["sku"], 0.0)
        needed[item["sku"]] = rate * (lead_time_days + safety_days)
    orders = []
    for item in active:
        shortfall = needed[item["sku"]] - item["on_hand"] - item.get("on_order", 0)
        if shortfall <= 0:
            continue
        pack = item.get("pack_size", 1)
        quantity = math.ceil(shortfall / pack) * pack
        orders.append({"sku": item["sku"], "name": item["name"], "quantity": quantity})
    orders.sort(key=lambda order: order["sku"])
    lines = [f"{len(orders)} of {len(active)} active items need restocking"]
    for order in orders:
        lines.append(f"  {order['sku']}  {order['name']:<24} order {order['quantity']}")
    return orders, "\\n".join(lines)
''',
    ),
    (
        "Rename the method `wd` to `withdraw` and update every call to it in this class. Change nothing else, "
        "and return the complete rewritten class.",
        '''class BankAccount:
    def __init__(self, owner, balance=0.0, overdraft_limit=0.0):
        if balance < 0:
            raise ValueError("opening balance cannot be negative")
        self.owner = owner
        self.balance = balance
        self.overdraft_limit = overdraft_limit
        self.history = []

    def deposit(self, amount):
        if amount <= 0:
            raise ValueError("deposit must be positive")
        self.balance += amount
        self.history.append(("deposit", amount))
        return self.balance

    def wd(self, amount):
        if amount <= 0:
            raise ValueError("withdrawal must be positive")
        if self.balance - amount < -self.overdraft_limit:
            raise ValueError(f"insufficient funds: balance {self.balance:.2f}")
        self.balance -= amount
        self.history.append(("withdrawal", amount))
        return self.balance

    def transfer(self, other, amount):
        self.wd(amount)
        other.deposit(amount)
        return self.balance

    def close(self):
        remaining = self.balance
        if remaining < 0:
            raise ValueError(f"cannot close: {self.owner} owes {-remaining:.2f}")
        if remaining > 0:
            self.wd(remaining)
        return remaining
''',
    ),
    (
        "Add type hints to the parameters and return values of both functions (tasks map a name to the names "
        "it depends on). Keep the logic exactly as it is, and return the complete rewritten code.",
        '''from collections import deque


def build_order(tasks):
    dependents = {name: [] for name in tasks}
    remaining = {}
    for name, requires in tasks.items():
        for dependency in set(requires):
            if dependency not in tasks:
                raise KeyError(f"{name} depends on unknown task {dependency}")
            dependents[dependency].append(name)
        remaining[name] = len(set(requires))
    ready = deque(sorted(name for name, count in remaining.items() if count == 0))
    order = []
    while ready:
        name = ready.popleft()
        order.append(name)
        for dependent in sorted(dependents[name]):
            remaining[dependent] -= 1
            if remaining[dependent] == 0:
                ready.append(dependent)
    if len(order) != len(tasks):
        stuck = sorted(name for name in tasks if name not in order)
        raise ValueError(f"dependency cycle among: {', '.join(stuck)}")
    return order


def stages(tasks):
    level = {}
    for name in build_order(tasks):
        level[name] = 1 + max((level[dependency] for dependency in tasks[name]), default=-1)
    grouped = {}
    for name, depth in level.items():
        grouped.setdefault(depth, []).append(name)
    return [sorted(grouped[depth]) for depth in sorted(grouped)]
''',
    ),
    (
        "Replace the hard-coded limits in `password_problems` (12, 128, the 3 character classes and the 3 "
        "repeated characters) with module-level constants `MIN_LENGTH`, `MAX_LENGTH`, `MIN_CLASSES` and "
        "`MAX_REPEAT`, in the messages too. Change nothing else and return the complete rewritten code.",
        '''import string


def password_problems(password, username=""):
    problems = []
    if len(password) < 12:
        problems.append("shorter than 12 characters")
    if len(password) > 128:
        problems.append("longer than 128 characters")
    classes = 0
    for group in (string.ascii_lowercase, string.ascii_uppercase, string.digits, string.punctuation):
        if any(char in group for char in password):
            classes += 1
    if classes < 3:
        problems.append("uses fewer than 3 of: lower case, upper case, digits, symbols")
    run = 1
    for previous, char in zip(password, password[1:]):
        run = run + 1 if char == previous else 1
        if run > 3:
            problems.append("repeats a character more than 3 times in a row")
            break
    if username and username.lower() in password.lower():
        problems.append("contains the user name")
    return problems


def is_strong(password, username=""):
    return not password_problems(password, username)
''',
    ),
    (
        "Add input validation at the start of this function: raise `TypeError` if `text` is not a string and "
        "`ValueError` if `width` is not greater than the length of `indent`. Change nothing else and return "
        "the complete rewritten function.",
        '''def wrap_text(text, width=72, indent="", break_long_words=True):
    out = []
    for block in text.split("\\n\\n"):
        words = block.split()
        if not words:
            continue
        if out:
            out.append("")
        line = ""
        for word in words:
            while break_long_words and len(indent) + len(word) > width:
                if line:
                    out.append(indent + line)
                    line = ""
                room = width - len(indent)
                out.append(indent + word[:room])
                word = word[room:]
            if not word:
                continue
            if line and len(indent) + len(line) + 1 + len(word) > width:
                out.append(indent + line)
                line = word
            else:
                line = f"{line} {word}" if line else word
        if line:
            out.append(indent + line)
    return "\\n".join(out)
''',
    ),
    (
        "Add a docstring to the class and to each of its public methods, explaining the parameters and the "
        "return values. Do not change the code itself, and return the complete class with the docstrings.",
        '''import time


class TokenBucket:
    def __init__(self, rate, capacity, clock=time.monotonic):
        if rate <= 0 or capacity <= 0:
            raise ValueError("rate and capacity must be positive")
        self.rate = rate
        self.capacity = capacity
        self.clock = clock
        self.tokens = float(capacity)
        self.updated = clock()

    def _refill(self):
        now = self.clock()
        elapsed = max(0.0, now - self.updated)
        self.tokens = min(self.capacity, self.tokens + elapsed * self.rate)
        self.updated = now

    def try_acquire(self, amount=1):
        if amount > self.capacity:
            raise ValueError(f"cannot take {amount} tokens from a bucket of {self.capacity}")
        self._refill()
        if self.tokens >= amount:
            self.tokens -= amount
            return True
        return False

    def wait_time(self, amount=1):
        self._refill()
        missing = amount - self.tokens
        return 0.0 if missing <= 0 else missing / self.rate

    def acquire(self, amount=1, sleep=time.sleep):
        while not self.try_acquire(amount):
            sleep(self.wait_time(amount))
''',
    ),
    (
        "Rename the function `dist` to `haversine_km` and update every call to it in this module. Change "
        "nothing else, and return the complete rewritten module.",
        '''import math

EARTH_RADIUS_KM = 6371.0


def dist(a, b):
    lat1, lon1 = map(math.radians, a)
    lat2, lon2 = map(math.radians, b)
    h = math.sin((lat2 - lat1) / 2) ** 2 + math.cos(lat1) * math.cos(lat2) * math.sin((lon2 - lon1) / 2) ** 2
    return 2 * EARTH_RADIUS_KM * math.asin(math.sqrt(h))


def track_length(points):
    return sum(dist(a, b) for a, b in zip(points, points[1:]))


def split_track(points, times, max_gap_s=300, max_jump_km=1.0):
    segments = [[points[0]]] if points else []
    for i in range(1, len(points)):
        gap = times[i] - times[i - 1]
        if gap > max_gap_s or dist(points[i - 1], points[i]) > max_jump_km:
            segments.append([])
        segments[-1].append(points[i])
    return segments
''',
    ),
    (
        "Replace every `print` call in this function with a call on a module-level logger "
        "(`logger = logging.getLogger(__name__)`), `warning` for skipped expenses and `info` for the rest. "
        "Keep everything else and return the complete rewritten code.",
        '''def settle_debts(expenses, people):
    balance = {person: 0.0 for person in people}
    for payer, amount, shared_by in expenses:
        if payer not in balance or not shared_by:
            print(f"skipping an expense paid by {payer}")
            continue
        balance[payer] += amount
        for person in shared_by:
            balance[person] -= amount / len(shared_by)
    creditors = sorted([person, owed] for person, owed in balance.items() if owed > 0.005)
    debtors = sorted([person, -owed] for person, owed in balance.items() if owed < -0.005)
    payments = []
    while creditors and debtors:
        creditor, debtor = creditors[-1], debtors[-1]
        amount = min(creditor[1], debtor[1])
        payments.append((debtor[0], creditor[0], round(amount, 2)))
        print(f"{debtor[0]} pays {amount:.2f} to {creditor[0]}")
        creditor[1] -= amount
        debtor[1] -= amount
        if creditor[1] < 0.005:
            creditors.pop()
        if debtor[1] < 0.005:
            debtors.pop()
    return payments
''',
    ),
    (
        "Replace the two `for i in range(len(...))` loops in this function with loops over `zip` or "
        "`enumerate`, whichever fits. Keep the behaviour the same and return the complete rewritten function.",
        '''def daily_summary(timestamps, temperatures):
    if len(timestamps) != len(temperatures):
        raise ValueError("timestamps and temperatures differ in length")
    days = {}
    for i in range(len(timestamps)):
        temperature = temperatures[i]
        if temperature is None:
            continue
        day = timestamps[i][:10]
        if day not in days:
            days[day] = {"low": temperature, "high": temperature, "total": 0.0, "count": 0}
        stats = days[day]
        stats["low"] = min(stats["low"], temperature)
        stats["high"] = max(stats["high"], temperature)
        stats["total"] += temperature
        stats["count"] += 1
    lines = []
    ordered = sorted(days)
    for i in range(len(ordered)):
        stats = days[ordered[i]]
        mean = stats["total"] / stats["count"]
        change = ""
        if i > 0:
            previous = days[ordered[i - 1]]
            change = f" ({mean - previous['total'] / previous['count']:+.1f} since the previous day)"
        lines.append(f"{ordered[i]}: {stats['low']:.1f} to {stats['high']:.1f}, mean {mean:.1f}{change}")
    return "\\n".join(lines)
''',
    ),
    (
        "Add input validation to `matmul`: raise `ValueError`, with both shapes in the message, when the rows "
        "of `a` or of `b` have different lengths or when the number of columns of `a` is not the number of "
        "rows of `b`. Change nothing else and return the complete rewritten code.",
        '''def transpose(matrix):
    return [list(row) for row in zip(*matrix)]


def matmul(a, b):
    columns = transpose(b)
    result = []
    for row in a:
        result.append([sum(x * y for x, y in zip(row, column)) for column in columns])
    return result


def identity(size):
    return [[1 if i == j else 0 for j in range(size)] for i in range(size)]


def matrix_power(matrix, exponent):
    if exponent < 0:
        raise ValueError("negative exponents are not supported")
    result = identity(len(matrix))
    base = matrix
    while exponent:
        if exponent & 1:
            result = matmul(result, base)
        base = matmul(base, base)
        exponent >>= 1
    return result


def fibonacci(n):
    return matrix_power([[1, 1], [1, 0]], n)[0][1]
''',
    ),
    (
        "Rewrite this function to collect the pieces of HTML in a list and join them once at the end, instead "
        "of concatenating strings with `+=`. Keep the output exactly the same and return the complete "
        "rewritten function.",
        '''from html import escape


def render_table(rows, columns, caption=None, numeric=()):
    html = "<table>\\n"
    if caption:
        html += "  <caption>" + escape(caption) + "</caption>\\n"
    html += "  <thead><tr>"
    for column in columns:
        html += "<th>" + escape(column) + "</th>"
    html += "</tr></thead>\\n  <tbody>\\n"
    for index, row in enumerate(rows):
        css = "even" if index % 2 else "odd"
        html += '    <tr class="' + css + '">'
        for column in columns:
            value = row.get(column, "")
            if column in numeric and value != "":
                html += '<td class="num">' + f"{value:,.2f}" + "</td>"
            else:
                html += "<td>" + escape(str(value)) + "</td>"
        html += "</tr>\\n"
    html += "  </tbody>\\n"
    if not rows:
        html += "  <!-- no rows -->\\n"
    html += "</table>"
    return html
''',
    ),
    (
        "Add a `separator` keyword parameter (default `\"-\"`) to both functions and use it instead of the "
        "hard-coded hyphen, passing it from `unique_slugs` to `slugify`. Change nothing else and return the "
        "complete rewritten code.",
        '''import re
import unicodedata


def slugify(title, max_length=60):
    text = unicodedata.normalize("NFKD", title)
    text = text.encode("ascii", "ignore").decode("ascii").lower()
    text = re.sub(r"[^a-z0-9]+", "-", text).strip("-")
    if len(text) > max_length:
        text = text[:max_length].rsplit("-", 1)[0]
    return text or "untitled"


def unique_slugs(titles, max_length=60):
    seen = {}
    slugs = []
    for title in titles:
        base = slugify(title, max_length)
        count = seen.get(base, 0)
        slug = base if count == 0 else f"{base}-{count + 1}"
        while slug in seen:
            count += 1
            slug = f"{base}-{count + 1}"
        seen[base] = count + 1
        seen.setdefault(slug, 1)
        slugs.append(slug)
    return slugs
''',
    ),
    (
        "Rename the variable `c` to `best` everywhere in `latest_version`. Do not change anything else, and "
        "return the complete rewritten code.",
        '''def version_key(text):
    core, _, pre = text.strip().lstrip("vV").partition("-")
    parts = core.split(".")
    if not 1 <= len(parts) <= 4 or not all(part.isdigit() for part in parts):
        raise ValueError(f"invalid version {text!r}")
    numbers = tuple(int(part) for part in parts) + (0,) * (4 - len(parts))
    # a release sorts after its pre-releases: 1.2.0-rc1 < 1.2.0
    return numbers, pre == "", pre


def sort_versions(versions, newest_first=True):
    return sorted(versions, key=version_key, reverse=newest_first)


def latest_version(versions, allow_prerelease=False, below=None):
    c = None
    limit = version_key(below) if below is not None else None
    for text in versions:
        key = version_key(text)
        if key[2] and not allow_prerelease:
            continue
        if limit is not None and key >= limit:
            continue
        if c is None or key > version_key(c):
            c = text
    if c is None:
        raise LookupError("no version matches")
    return c
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
