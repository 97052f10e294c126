from baige.cli import main

main()
