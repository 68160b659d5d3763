"""``caffe-compat models list`` and ``caffe-compat models verify FILE.caffemodel``.

``verify`` checks a file against its model card (sha256 where the card knows it, expected blob names
and shapes): exit 0 when it matches, 1 when it does not, 2 when unreadable or unknown.
"""

from __future__ import annotations

from caffe_compat.cli.output import dump_json, print_table


def register(sub) -> None:
    p = sub.add_parser("models", help="model cards of published Caffe models")
    verbs = p.add_subparsers(dest="verb", metavar="VERB")
    verbs.required = True
    v = verbs.add_parser("verify", help="check a caffemodel against its card")
    v.add_argument("file")
    v.add_argument("--card", help="card name (default: the card listing this file name)")
    v.add_argument("--json", action="store_true")
    v.set_defaults(func=run_verify)
    ls = verbs.add_parser("list", help="list the cards")
    ls.set_defaults(func=run_list)


def run_list(args) -> int:
    from caffe_compat.models import load_cards

    rows = [[name, ", ".join(card["files"]), card.get("obtain", "")[:70]] for name, card in load_cards().items()]
    print_table(rows, ["card", "files", "where to get it"])
    return 0


def run_verify(args) -> int:
    from caffe_compat.errors import CaffeCompatError
    from caffe_compat.models import load_cards, verify_caffemodel

    card = None
    if args.card:
        cards = load_cards()
        if args.card not in cards:
            raise CaffeCompatError(f"no model card named '{args.card}' (known: {', '.join(sorted(cards))})")
        card = cards[args.card]
    result = verify_caffemodel(args.file, card)
    if args.json:
        dump_json(result)
    else:
        print(f"{args.file}: card '{result['card']}': " + ("OK" if result["ok"] else "MISMATCH"))
        if "sha256" in result:
            print(f"  sha256 {result['sha256']}")
        for problem in result["problems"]:
            print(f"  - {problem}")
    return 0 if result["ok"] else 1
