"""Teacher-forced accuracy measurements (tests/e2e/test_fp8_accuracy.py on CPU, tests/gpu/test_real_model_gpu.py):
plain English passages and their pooled figures. The passages: seven genres (a story, two explanations, a letter,
a history, instructions, an interview), 1,994 SmolLM2 tokens in all, written for this project. One passage
decides too little: the same W8A8 arithmetic summed in two orders gave a top-1 agreement of 0.900 and 0.912 over
the first passage (330 rows), 0.9004 and 0.9019 over all seven."""
from __future__ import annotations

import math

import torch

LIGHTHOUSE = (
    "The lighthouse stood at the end of a narrow spit of land, where the river met the sea. For more than a "
    "hundred years its keepers had climbed the spiral stairs each evening to light the lamp, and each morning "
    "they had climbed them again to put it out. The work was simple, but it was never finished. Salt crept into "
    "the brass fittings, gulls nested on the gallery rail, and every winter the storms tore shingles from the "
    "roof of the keeper's cottage.\n\n"
    "When the last keeper retired, the town council argued for months about what to do with the building. Some "
    "wanted to sell it to a hotel company that promised to bring visitors and jobs. Others said that a "
    "lighthouse belonged to everyone who had ever been guided home by its beam, and that it should become a "
    "museum. In the end they reached a compromise: the tower would stay open to the public, and the cottage "
    "would be rented to artists who agreed to teach a class in the village school once a week.\n\n"
    "The first artist to arrive was a painter from the city who had never lived near the ocean. She spent her "
    "first weeks walking along the beach at low tide, filling notebooks with sketches of driftwood, rope and "
    "broken shells. The children in her class were puzzled at first. They had seen the sea every day of their "
    "lives and could not understand why anyone would want to draw it. But by the end of the spring they had "
    "learned to look at the water the way she did, noticing how its color changed with the weather and the "
    "hour, and how the light from the tower swept across the waves long after the sun had gone down."
)

BREAD = (
    "Bread rises because of a small living thing that most bakers never see. Yeast is a single-celled fungus, and "
    "a spoonful of the dried kind contains billions of cells waiting for water and warmth. When the baker mixes "
    "flour, water and yeast, the cells wake up and begin to feed on the sugars in the flour. As they feed, they "
    "release carbon dioxide and a little alcohol.\n\n"
    "The gas would simply escape if it were not for gluten. Wheat flour contains two proteins that, once they "
    "are wet and worked by kneading, link together into long elastic strands. These strands form a web that "
    "traps the bubbles of gas, and the dough slowly swells like a balloon. This is why bread made from rye or "
    "rice flour, which form little gluten, tends to be dense and flat.\n\n"
    "Time matters as much as ingredients. A dough left to rise slowly in a cool kitchen develops more flavor "
    "than one rushed in a warm oven, because the yeast and the bacteria that live alongside it have longer to "
    "produce acids and aromatic compounds. Many bakers leave their dough in the refrigerator overnight for this "
    "reason.\n\n"
    "In the oven, the heat does three things at once. The gas in the bubbles expands, giving the loaf a final "
    "burst of growth. The yeast dies as the temperature passes about sixty degrees Celsius. Finally, the "
    "starches set and the proteins firm up, fixing the shape of the loaf, while the surface browns into a crust "
    "through the same reactions that color roasted coffee and toasted nuts."
)

LETTER = (
    "Dear Margaret,\n\n"
    "Thank you for your letter, which arrived on Tuesday along with the first real snow of the winter. I read "
    "it by the window while the children built a rather lopsided snowman in the garden. You asked how we are "
    "settling into the new house, and the honest answer is: slowly, but happily.\n\n"
    "The house is older than we realized when we bought it. The floors creak in places we did not notice during "
    "the viewing, and the kitchen tap makes a sound like a distant trumpet whenever someone runs hot water. "
    "Daniel has promised to fix it, but he has been promising that since October. On the other hand, the "
    "neighbors could not be kinder. The couple next door brought us a casserole on our first evening, and their "
    "son has been teaching ours how to play chess.\n\n"
    "My new job is going well. The office is small, only eight of us, and everyone is expected to do a bit of "
    "everything. Last week I found myself answering the telephone, ordering paper and presenting our plans to "
    "the town council, all on the same afternoon. It is tiring, but I have not been bored once.\n\n"
    "Will you still be able to visit in the spring? The spare room is finally free of boxes, and there is a "
    "walk along the river that I am certain you would love. Write soon and tell me everything about your trip.\n\n"
    "With love,\nEleanor"
)

CANALS = (
    "Before the railways, the cheapest way to move heavy goods across the country was by water. A single horse "
    "walking along a towpath could pull a barge carrying thirty tons of coal, far more than the same horse could "
    "drag in a cart over the rough roads of the time. For this reason the late eighteenth century saw a rush of "
    "canal building, as mine owners and merchants raised money to dig new waterways between their towns.\n\n"
    "Building a canal was a remarkable feat of engineering with the tools available. Workers dug the channels by "
    "hand, lined them with clay to stop the water from draining away, and built locks to carry boats up and down "
    "hills. Where a valley was too deep, engineers built aqueducts to carry the canal across it; where a hill "
    "was too high, they dug tunnels through it, and the boatmen pushed their barges through by lying on their "
    "backs and walking along the tunnel roof.\n\n"
    "The canals brought great changes to the towns they reached. The price of coal fell sharply, factories "
    "could be built far from the mines, and fragile goods such as pottery could travel safely for the first "
    "time. Yet their success did not last long. Within fifty years the railways offered faster journeys, and "
    "many canal companies were bought by the railway companies that competed with them.\n\n"
    "Today most canals carry holiday boats rather than coal. Volunteers have restored many of the old locks, and "
    "the towpaths where horses once walked have become quiet routes for walkers and cyclists."
)

GARDEN = (
    "Starting a vegetable garden does not require much land, but it does require a little planning. First, "
    "choose a spot that receives at least six hours of direct sunlight each day. Most vegetables will grow "
    "poorly in shade, no matter how well you water and feed them. The spot should also be close to a source of "
    "water, because you will be carrying a lot of it during the summer.\n\n"
    "Next, prepare the soil. Remove any grass and weeds, then dig the ground to the depth of a spade, breaking up "
    "large clumps as you go. Mix in a generous layer of compost, which improves the structure of the soil and "
    "adds nutrients. If your soil is heavy clay, a raised bed filled with a mixture of topsoil and compost may "
    "be easier to manage.\n\n"
    "When you choose what to grow, begin with a few reliable crops. Lettuce, radishes and beans grow quickly and "
    "forgive most mistakes. Tomatoes and peppers need more warmth and attention, but they reward the effort. "
    "Read the packet of each seed carefully: it will tell you how deep to plant, how far apart to space the "
    "plants, and when to sow them in your region.\n\n"
    "Finally, keep a simple notebook. Write down what you planted, when you planted it and how well it grew. "
    "After one or two seasons you will have a record of what suits your garden, and each year will be easier "
    "and more productive than the last."
)

MOON = (
    "The Moon has no light of its own. What we see on a clear night is sunlight reflected from its grey, dusty "
    "surface, and the shape of the bright part depends on where the Moon is in its orbit. When it lies between "
    "the Earth and the Sun, the side facing us is dark, and we call it a new moon. Over the following two weeks "
    "more and more of the sunlit side comes into view, until the full moon rises in the east just as the Sun "
    "sets in the west.\n\n"
    "Because the Moon takes the same time to turn once on its axis as it takes to travel once around the Earth, "
    "it always shows us the same face. The far side was a mystery until the first spacecraft photographed it, "
    "revealing a surface crowded with craters and almost free of the dark plains that give the near side its "
    "familiar pattern.\n\n"
    "The Moon also shapes life on Earth. Its gravity pulls on the oceans, raising the tides twice a day, and "
    "many animals along the shore time their feeding and breeding to the rhythm of the water. Over millions of "
    "years the same pull has slowed the Earth's rotation, so that the days are slowly growing longer."
)

INTERVIEW = (
    "\"How long have you been repairing clocks?\" the reporter asked.\n\n"
    "\"Nearly forty years,\" said the old man, setting down a tiny screwdriver. \"My father had this shop "
    "before me. I used to sit on that stool in the corner after school and watch him work. He never explained "
    "anything. He just let me watch, and when I asked a question he would hand me a broken clock and tell me to "
    "find the answer myself.\"\n\n"
    "\"Do people still bring you clocks to repair?\"\n\n"
    "\"More than you would think. Not many wear watches anymore, but people keep the clock that belonged to their "
    "grandmother, or the one that hung in their school. They bring it to me and say that it has stopped, and "
    "what they really mean is that they miss the sound of it in the house.\"\n\n"
    "\"What is the hardest part of the job?\"\n\n"
    "He thought for a moment. \"Patience. A clock will tell you what is wrong with it, but only if you are "
    "willing to listen. Young people want to replace every part at once. Most of the time the problem is one "
    "small spring, or a little dirt where it should not be.\""
)

PASSAGES = {"lighthouse": LIGHTHOUSE, "bread": BREAD, "letter": LETTER, "canals": CANALS, "garden": GARDEN,
            "moon": MOON, "interview": INTERVIEW}


def pooled_figures(logps: list[torch.Tensor], ref_logps: list[torch.Tensor],
                   passages: list[list[int]]) -> tuple[float, float, float]:
    """Rows 0 .. n-2 of each passage predict its tokens 1 .. n-1. Over the rows of all passages: (share of rows
    whose argmax is the reference's, exp of the mean negative log-probability of the next tokens, mean
    KL(reference || engine) in nats: steadier than the top-1 agreement, which rows near a tie decide)."""
    rows = torch.cat([lp[:-1] for lp in logps])
    ref_rows = torch.cat([lp[:-1] for lp in ref_logps])
    nxt = torch.tensor([t for ids in passages for t in ids[1:]], device=rows.device)
    agree = (rows.argmax(-1) == ref_rows.argmax(-1)).float().mean().item()
    nll = -rows.gather(1, nxt[:, None]).mean().item()
    kl = (ref_rows.exp() * (ref_rows - rows)).sum(-1).mean().item()
    return agree, math.exp(nll), kl
