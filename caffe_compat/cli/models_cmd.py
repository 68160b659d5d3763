"""``caffe-compat models list [--json]``, ``models fetch NAME [--cache DIR]`` and ``models verify FILE``.

``list`` prints the cards with the digests they know, whether ``fetch`` can download them, and the whole
text of where to get each (addresses are never cut, whatever the terminal width); ``--json`` gives the
same with the addresses apart.  ``fetch`` downloads a card's files (open_nsfw: into ``DIR/nsfw``,
verified by sha256) and prints their folder; a card without a fetcher exits 2 saying where to download it
by hand.  ``verify`` checks a file against its model card (its size and every digest the card lists for
it: sha256, sha1, md5; expected blob names and shapes): exit 0 when it matches, 1 when it does not, 2 when
the file is missing or unreadable, no card lists its name, or the cards themselves are missing.
"""

from __future__ import annotations

from caffe_compat.cli.output import dump_json, print_table


def register(sub) -> None:
    from caffe_compat.models import FETCHERS

    p = sub.add_parser("models", help="model cards of published Caffe models: list, fetch, verify")
    verbs = p.add_subparsers(dest="verb", metavar="VERB", help="what to do with the cards")
    verbs.required = True
    ls = verbs.add_parser("list", help="list the cards: files, digests, where to get them")
    ls.add_argument("--json", action="store_true", help="print the cards as JSON")
    ls.set_defaults(func=run_list)
    f = verbs.add_parser("fetch", help="download a card's files (where the card has a fetcher)")
    f.add_argument("name", metavar="NAME",
                   help=f"card name (models list); downloadable: {', '.join(sorted(FETCHERS))}; the others "
                        "say where to download them by hand")
    f.add_argument("--cache", default=".cache", metavar="DIR",
                   help="folder to download into (default .cache; created when missing)")
    f.set_defaults(func=run_fetch)
    v = verbs.add_parser("verify", help="check a caffemodel against its card")
    v.add_argument("file", help="the caffemodel to check (its card is found by file name)")
    v.add_argument("--card", help="card name (default: the card listing this file name)")
    v.add_argument("--json", action="store_true", help="print the result as JSON")
    v.set_defaults(func=run_verify)


def _summaries() -> list[dict]:
    from caffe_compat.models import DIGESTS, FETCHERS, download_addresses, load_cards

    summaries = []
    for name, card in load_cards().items():
        files = card.get("files", {})
        known = sorted({d for meta in files.values() for d in DIGESTS if (meta or {}).get(d)}, key=DIGESTS.index)
        summaries.append({"card": name, "files": list(files), "digests": known,
                          "fetch": f"caffe-compat models fetch {name}" if name in FETCHERS else None,
                          "addresses": download_addresses(card), "obtain": card.get("obtain", "")})
    return summaries


def run_list(args) -> int:
    summaries = _summaries()
    if args.json:
        dump_json(summaries)
        return 0
    rows = [[s["card"], ", ".join(s["files"]) or "-", ", ".join(s["digests"]) or "-", s["fetch"] or "by hand"]
            for s in summaries]
    print_table(rows, ["card", "files", "digests", "fetch"])
    print("\nwhere to get them:")
    for s in summaries:
        print(f"  {s['card']}: {s['obtain'] or '(the card does not say)'}")
    return 0


def run_fetch(args) -> int:
    from caffe_compat.models import fetch_model

    print(fetch_model(args.name, args.cache))
    return 0


def run_verify(args) -> int:
    from pathlib import Path

    from caffe_compat.models import card_named, verify_caffemodel

    result = verify_caffemodel(args.file, card_named(args.card) if args.card else None)
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
        if not result["ok"] and result.get("by_name"):
            cards = ", ".join(f"'{name}'" for name in result["by_name"])
            print(f"  (the card was picked by the file name '{Path(args.file).name}', which {cards} "
                  f"list{'s' if len(result['by_name']) == 1 else ''}: another net's file of that name is no match; "
                  "--card NAME checks it against another card)")
    return 0 if result["ok"] else 1
