from autopar.cli.main import main

raise SystemExit(main())
