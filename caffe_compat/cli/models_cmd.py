"""``caffe-compat models list`` and ``caffe-compat models verify FILE.caffemodel``.

``verify`` checks a file against its model card (its size and every digest the card lists for it:
sha256, sha1, md5; expected blob names and shapes): exit 0 when it matches, 1 when it does not, 2 when
the file is missing or unreadable, no card lists its name, or the cards themselves are missing.
``list`` prints the cards with the digests they know.
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
    from caffe_compat.models import DIGESTS, load_cards

    rows = []
    for name, card in load_cards().items():
        files = card.get("files", {})
        known = sorted({d for meta in files.values() for d in DIGESTS if (meta or {}).get(d)}, key=DIGESTS.index)
        rows.append([name, ", ".join(files) or "-", ", ".join(known) or "-", card.get("obtain", "")[:70]])
    print_table(rows, ["card", "files", "digests", "where to get it"])
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
        for name, value in result["digests"].items():
            print(f"  {name} {value}")
        if not result["digests"]:
            print("  (the card lists no digest for this file: only the blob shapes were checked)")
        for problem in result["problems"]:
            print(f"  - {problem}")
    return 0 if result["ok"] else 1
